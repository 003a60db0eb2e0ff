"""Chat fine-tuning through the CLI: `data=hf_chat` on a tiny Llama directory whose tokenizer has
a chat template; step 1's loss is the base model's mean loss over the assistant's tokens as
`apply_chat_template(..., return_assistant_tokens_mask=True)` marks them."""

from __future__ import annotations

import json

import pytest
import torch

from tests.helpers.tiny_chat import chat_template, write_chat_jsonl, write_tiny_llama

from ..conftest import run_train

transformers = pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
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


def chat_lora_run(tmp_path, model_dir, data, name: str, *layout: str, template=None):
    """The issue's LoRA chat run, as issue 38 wrote it (no trainer.monitor: with no validation data
    the run follows the training loss): SGD, constant lr, one global batch of the whole file, 4 steps."""
    run_dir = tmp_path / name
    run = run_train(
        ["model=hf_causal_lm", f"model.path={model_dir}", "data=hf_chat", f"data.dataset.data_files={data}",
         "data.dataset.val_fraction=0", "loss=model", "metrics=none", "+adapter=lora", "adapter.r=8",
         "adapter.dropout=0", "optimizer=sgd", "scheduler=constant", "trainer.batch_size=8",
         "trainer.max_steps=4", "trainer.log_freq=1",
         *([f"data.dataset.chat_template={template}"] if template else []), *layout],
        run_dir,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run, run_dir


@pytest.mark.slow
def test_lora_on_chat_data_under_zero3_on_two_ranks_is_the_one_rank_update_and_exports_for_peft(tmp_path):
    """Issue 38's acceptance run. Step 1's loss is the base model's loss over the assistant's
    tokens as the template's markers mark them, though the run finds them without the markers
    (the config's template is the same one without them: prefix renders); ZeRO-3 on 2 ranks and
    ZeRO-0 on one train the same adapter; the adapter exports for PEFT and merged."""
    peft = pytest.importorskip("peft", reason="needs the hf extra: pip install -e '.[hf]'")
    from safetensors.torch import load_file

    from framework.export import main as export

    model_dir = write_tiny_llama(tmp_path / "llama", generation_markers=True)
    data = write_chat_jsonl(tmp_path / "chat.jsonl")  # 8 conversations: one global batch
    template = tmp_path / "plain.jinja"
    template.write_text(chat_template(generation_markers=False))
    run, two = chat_lora_run(
        tmp_path, model_dir, data, "zero3x2", "+strategy=zero3", "trainer.devices=2", template=template
    )
    assert f"data: the tokenizer of {model_dir}" in run.stdout and "adapter: LoRA r=8 on" in run.stdout
    steps = [json.loads(line) for line in (two / "metrics.jsonl").read_text().splitlines()]
    first = next(s for s in steps if s["kind"] == "step" and s["step"] == 1)
    assert first["loss"] == pytest.approx(assistant_token_loss(model_dir, data), abs=1e-4)
    _, one = chat_lora_run(tmp_path, model_dir, data, "zero0x1", "+strategy=zero0", "trainer.devices=1")

    for run_dir in (two, one):
        assert export([str(run_dir / "checkpoints"), str(run_dir / "adapter"), "--adapter"]) == 0
    a, b = (load_file(str(d / "adapter" / "adapter_model.safetensors")) for d in (two, one))
    assert a.keys() == b.keys() and any("lora_B" in k for k in a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) < 1e-5
    assert all(float(a[k].abs().max()) > 0 for k in a if "lora_B" in k)  # lora_B moved off zero
    size = (two / "adapter" / "adapter_model.safetensors").stat().st_size
    assert size < 0.5 * (model_dir / "model.safetensors").stat().st_size

    base = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    adapted = peft.PeftModel.from_pretrained(base, two / "adapter").eval()
    assert export([str(two / "checkpoints"), str(two / "merged"), "--hf"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(two / "merged").eval()
    ids = torch.tensor([[1, 5, 9, 12, 3, 7]])
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, atol=1e-4)
