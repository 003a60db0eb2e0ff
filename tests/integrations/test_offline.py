"""Nothing reaches the network: a wrong model path is one line at once (transformers takes a name
that is not a directory for a hub id and retries the network for half a minute), and loading a
local model, tokenizer and data files works with every socket refused."""

from __future__ import annotations

import socket
import time

import pytest

from framework.errors import ConfigError

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")


@pytest.fixture
def no_network(monkeypatch):
    """Every connection and name look-up fails (and is recorded); proxies point nowhere."""
    attempts: list[object] = []

    def refuse(*args, **kwargs):
        attempts.append(args[1:] or kwargs)
        raise OSError("network blocked by the test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", lambda *a, **k: refuse(None, *a))
    for key in ("HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        monkeypatch.setenv(key, "http://127.0.0.1:9")
    return attempts


@pytest.mark.parametrize("path", ["my-llama", "./nope", "org/model"])
def test_a_model_path_that_is_no_directory_is_one_line_at_once(no_network, path):
    from framework.integrations import hf_models

    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"model\.path=.*no such directory.*nothing is downloaded") as err:
        hf_models.causal_lm(path)
    assert time.perf_counter() - start < 2.0
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="no such directory"):
        hf_models.sequence_classification(path, num_labels=2)
    assert no_network == []


def test_a_directory_without_config_json_says_what_it_should_hold(no_network, tmp_path):
    from framework.integrations import hf_models

    with pytest.raises(ConfigError, match="no config.json"):
        hf_models.causal_lm(str(tmp_path))
    assert no_network == []


def test_local_model_tokenizer_and_files_load_with_the_network_blocked(no_network, tmp_path):
    from framework.data.datasets.hf import hf_text, load_tokenizer
    from framework.integrations import hf_models

    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama")
    model = hf_models.causal_lm(str(tmp_path / "llama"))
    assert model.config.hidden_size == 16
    (tmp_path / "notes.jsonl").write_text("".join(f'{{"text": "note {i} " }}\n' for i in range(200)))
    splits = hf_text(str(tmp_path / "notes.jsonl"), builder="json", block_size=16)
    assert len(splits.train) > 0
    with pytest.raises(FileNotFoundError, match="data.dataset.tokenizer=my-tokenizer: no such"):
        load_tokenizer("my-tokenizer")
    assert no_network == []
