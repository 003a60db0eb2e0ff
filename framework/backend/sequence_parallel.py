"""Sequence parallelism for Hugging Face causal LMs: DeepSpeed Ulysses (ALST), each rank of a
sequence-parallel group holding 1/degree of every sequence.

The ranks of one group get the same batch from the loader (data is split over data-parallel
replicas only, `framework.plan.Mesh`), and each keeps its own slice (`shard`): position ids of the
whole sequence, labels shifted once over the whole sequence (Hugging Face's `shift_labels`, so a
slice's last token is scored against the next slice's first), then its chunk of every per-token
tensor. In each attention layer DeepSpeed's `UlyssesSPAttentionHF` trades the sequence split for a
head split (all-to-all), runs the model's own attention (sdpa, flash) over the whole sequence for
its heads, and trades back. The model's config names that attention ("ulysses_<core>", masks
made as for the core), so other models in the process keep theirs.

The loss is the framework's (`framework.engine.items`): each rank's model loss is the mean over its
slice's counted tokens, weighted so that the ranks' losses add up to the global batch's token mean
(the logged loss); `gradient_share` then corrects the gradient's scale, as DeepSpeed's ZeRO 0-2
sum the sequence-parallel ranks' gradients where ZeRO-3 averages them.

Evaluation and prediction run whole sequences on every rank with the core attention and the
model's mask (no all-to-all): the outputs of the model without sequence parallelism, at the
memory of an unsplit forward pass. Limits in training: the attention is causal over the whole
sequence and ignores `attention_mask` (DeepSpeed drops it), so padding must be on the right (a
left-padded batch is an error), and packed rows (position ids restarting per document) are
refused: the attention would run across their documents.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from framework.data.labels import IGNORE_INDEX
from framework.data.outputs import is_model_loss
from framework.errors import ConfigError
from framework.integrations import hf
from framework.integrations.hf import predicts_next_token
from framework.integrations.packed import documents
from framework.plan.run_plan import Mesh

CORE_ATTENTIONS = ("sdpa", "flash_attention_2", "flash_attention_3")  # what Ulysses wraps; CPU-verified: sdpa
PREFIX = "ulysses_"  # the attention name a prepared model's config carries: ulysses_sdpa, ...


def _attention_name(module: nn.Module) -> str:
    config = getattr(module, "config", None)
    return str(getattr(config, "_attn_implementation", None) or "eager")


def check_model(module: nn.Module, degree: int) -> None:
    """One-line errors for a model sequence parallelism cannot split: not a Hugging Face causal
    LM, or an attention Ulysses cannot wrap (eager). Head counts: `framework.backend.parallel.check_model`."""
    where = f"strategy.sequence_parallel.degree={degree}"
    if not (hasattr(getattr(module, "config", None), "save_pretrained") and predicts_next_token(module)):
        raise ConfigError(
            f"{where} needs a Hugging Face causal LM (e.g. transformers.LlamaForCausalLM, model=hf_llama); "
            f"{type(module).__name__} is not one: train it without sequence parallelism"
        )
    name = _attention_name(module).removeprefix(PREFIX)
    if name not in CORE_ATTENTIONS:
        raise ConfigError(
            f"{where}: the model's attention is {name!r}, which Ulysses cannot split (it needs the whole "
            f"attention mask); build the model with attn_implementation='sdpa' (or a flash attention)"
        )


def prepare(module: nn.Module, mesh: Mesh) -> Any:
    """Switch `module`'s attention to Ulysses and return DeepSpeed's sequence-parallel groups
    (the `mpu` that DeepSpeed's initialize takes). Collective the first time (it makes the groups)."""
    check_model(module, mesh.sp_size)
    core = _attention_name(module).removeprefix(PREFIX)
    name = PREFIX + core
    hf.register_attention(name, core, _ulysses_attention)  # masks as the core's
    groups = _groups(mesh.sp_size)
    module.config._attn_implementation = name  # type: ignore[union-attr]
    return groups


def _groups(degree: int) -> Any:
    """DeepSpeed's sequence-parallel groups module, made once per process (and again after the
    process group was destroyed and created anew)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu

    try:
        size = mpu.get_sequence_parallel_world_size()
    except (AssertionError, ValueError, RuntimeError):  # none yet, or made in a process group now gone
        mpu._release_sequence_parallel_groups()  # DeepSpeed's own reset for a torn-down world
        size = None
    if size is None:
        mpu.initialize_sequence_parallel(sequence_parallel_size=degree)
    elif size != degree:
        raise ConfigError(
            f"strategy.sequence_parallel.degree={degree}, but this process already runs sequence parallelism "
            f"of degree {size}: one process takes one degree (start a new process for another)"
        )
    return mpu


def _ulysses_attention(core: Callable[..., Any]) -> Callable[..., Any]:
    """An attention function for Hugging Face's registry: Ulysses around `core` in training (without
    a mask: one made for a slice means nothing for the whole sequence), `core` itself with the
    model's mask on whole sequences in evaluation. One `UlyssesSPAttentionHF` per shape of heads
    and batch (it checks every call's shapes against the batch size it was made for)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    made: dict[tuple[int, ...], tuple[Any, UlyssesSPAttentionHF]] = {}  # shape -> (its group, it)

    def attention(
        module: nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        if not module.training:
            return core(module, query, key, value, attention_mask, *args, **kwargs)
        shape = (query.shape[0], query.shape[1], key.shape[1], query.shape[3])
        group = mpu.get_sequence_parallel_group()
        if shape not in made or made[shape][0] is not group:  # new, or its groups were made anew
            made[shape] = (
                group,
                UlyssesSPAttentionHF(
                    attn=core,
                    batch_size=shape[0],
                    attn_head_count=shape[1],
                    attn_head_size=shape[3],
                    kv_head_count=shape[2],
                    num_hidden_layers=getattr(module.config, "num_hidden_layers", 1),
                    process_group=group,
                    seq_length_is_variable=True,
                ),
            )
        return made[shape][1](module, query, key, value, None, *args, **kwargs)

    return attention


def shard(batch: Any, mesh: Mesh, label_key: str = "labels") -> Any:
    """This rank's slice of a batch dict of whole sequences (see the module doc): `position_ids`
    (made when absent), labels shifted over the whole sequence as `shift_labels` and under
    `label_key`, and the chunk of every tensor that has the sequence as its second dimension;
    `attention_mask` is dropped (the attention is causal over the whole sequence)."""
    sp = mesh.sp_size
    if sp <= 1:
        return batch
    if not isinstance(batch, Mapping) or not isinstance(batch.get("input_ids"), torch.Tensor):
        raise ConfigError(
            f"strategy.sequence_parallel.degree={sp} needs dict batches with input_ids (a Hugging Face model "
            f"fed as model(**batch)); got a {type(batch).__name__}"
        )
    ids = batch["input_ids"]
    size, length = ids.shape[0], ids.shape[1]
    if length % sp:
        raise ConfigError(
            f"strategy.sequence_parallel.degree={sp} splits every sequence into {sp} equal parts, but this batch's "
            f"sequences have {length} tokens: pad them to a multiple of {sp} (e.g. the tokenizer's "
            f"pad_to_multiple_of={sp}, or a data.seq_len that divides by {sp})"
        )
    positions = batch.get("position_ids")
    if (
        isinstance(positions, torch.Tensor)
        and positions.dim() == 2
        and documents(positions, batch.get("attention_mask")) is not None
    ):
        raise ConfigError(
            f"strategy.sequence_parallel.degree={sp}: a batch holds packed rows (position ids restarting per "
            "document), but the attention under sequence parallelism is causal over whole rows and would run "
            "across documents: set data.dataset.pack=false, or strategy.sequence_parallel.degree=1"
        )
    out = {k: v for k, v in batch.items() if k not in ("attention_mask", label_key, "shift_labels")}
    if "position_ids" not in out:
        out["position_ids"] = torch.arange(length, device=ids.device).expand(size, length)
    shifted = batch.get("shift_labels")
    labels = batch.get(label_key)
    if shifted is None and isinstance(labels, torch.Tensor):
        shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    chunk = length // sp
    start, stop = chunk * mesh.sp_rank, chunk * (mesh.sp_rank + 1)
    for key, value in out.items():
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[1] == length:
            out[key] = value[:, start:stop]
    if shifted is not None:
        out["shift_labels"] = out[label_key] = shifted[:, start:stop].contiguous()
    return out


def training_batch(batch: Any, mesh: Mesh, loss: Any, label_key: str = "labels") -> Any:
    """`shard` for a training forward pass with the model's own loss: checks the loss and the
    padding, and adds `num_items_in_batch` (the slice's counted tokens, at least 1) so that a
    slice without any gives a loss of 0, not 0 / 0."""
    if not is_model_loss(loss):
        raise ConfigError(
            f"strategy.sequence_parallel.degree={mesh.sp_size} trains with the model's own loss over its slice of "
            "each sequence: use loss=model (Engine(model, 'model', ...))"
        )
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ConfigError(
            f"strategy.sequence_parallel.degree={mesh.sp_size}: a batch is padded on the left, but the attention "
            "under sequence parallelism is causal over whole sequences and ignores attention_mask; pad on the "
            "right (the tokenizer's padding_side='right') with labels -100 there"
        )
    out = shard(batch, mesh, label_key)
    if "shift_labels" in out:
        out["num_items_in_batch"] = (out["shift_labels"] != IGNORE_INDEX).sum().clamp_min(1)
    return out


def gradient_share(loss: torch.Tensor, mesh: Mesh, zero_stage: int) -> torch.Tensor:
    """`loss` with its value kept and its gradient scaled to what DeepSpeed expects of a
    sequence-parallel rank: ZeRO 0-2 sum the gradients of a group's ranks (they average over data-
    parallel ranks only), ZeRO-3 averages them, and the weighted losses of a group add up to the
    replica's loss, so at ZeRO 0-2 each rank's gradient counts 1 / degree."""
    if mesh.sp_size <= 1 or zero_stage >= 3:
        return loss
    share = 1.0 / mesh.sp_size
    return loss * share + (loss * (1.0 - share)).detach()
