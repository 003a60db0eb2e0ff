"""Chat fine-tuning through the CLI: `data=hf_chat` on a tiny Llama directory whose tokenizer has
a chat template; step 1's loss is the base model's mean loss over the assistant's tokens as
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks them."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.tiny_chat import chat_template, write_chat_jsonl, write_tiny_llama

from ..conftest import run_train

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)


def assistant_token_loss(model_dir, path) -> float:
    """The model's mean next-token loss over the assistant tokens the template's markers mark."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    total, count = 0.0, 0
    for line in path.read_text().splitlines():
        out = tok.apply_chat_template(
            json.loads(line)["messages"], return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = torch.tensor([out["input_ids"]]), torch.tensor(out["assistant_masks"][1:]).bool()
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, :-1]
        losses = torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none")
        total, count = total + float(losses[mask].sum()), count + int(mask.sum())
    return total / count


@pytest.mark.slow
def test_the_cli_trains_on_the_assistants_tokens_of_a_chat_file(tmp_path):
    """The model directory's tokenizer renders the conversations; the template given in the config
    (the same one without generation markers) finds the assistant's tokens by rendering prefixes."""
    model_dir = write_tiny_llama(tmp_path / "llama", generation_markers=True)
    data = write_chat_jsonl(tmp_path / "chat.jsonl")  # 8 conversations: one global batch
    template = tmp_path / "plain.jinja"
    template.write_text(chat_template(generation_markers=False))
    run = run_train(
        ["model=hf_causal_lm", f"model.path={model_dir}", "data=hf_chat", f"data.dataset.data_files={data}",
         "data.dataset.val_fraction=0", f"data.dataset.chat_template={template}", "loss=model", "metrics=none",
         "optimizer=sgd", "scheduler=constant", "trainer.batch_size=8", "trainer.max_steps=2",
         "trainer.log_freq=1", "trainer.monitor=loss", "trainer.checkpoint.enabled=false"],
        tmp_path / "run",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"data: the tokenizer of {model_dir}" in run.stdout
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    first = next(s for s in steps if s["kind"] == "step" and s["step"] == 1)
    assert first["loss"] == pytest.approx(assistant_token_loss(model_dir, data), abs=1e-4)
