"""Consolidated fp32 weights from a checkpoint, loadable into the plain `nn.Module`.

    python -m framework.export CKPT_DIR OUT         # CKPT_DIR: a checkpoints dir (newest complete
                                                    # checkpoint) or one checkpoint in it
    python -m framework.export CKPT_DIR OUT_DIR --hf   # a Hugging Face save_pretrained directory
    python -m framework.export CKPT_DIR OUT_DIR --adapter   # an adapter run's PEFT adapter directory

ZeRO 1-3 shards are merged with DeepSpeed's own zero_to_fp32; a ZeRO-0 checkpoint already holds
whole weights. A tensor-parallel checkpoint (ZeRO 1-3) is converted once to DeepSpeed's universal
format (`<checkpoint>_universal/`, as for a resume on another layout), which holds every
parameter whole in fp32 (zero_to_fp32 cannot merge tensor-parallel shards); a ZeRO-0 one is put
together from its ranks' shards by the split map AutoTP saved in it. OUT gets safetensors
(`.safetensors`) or a torch state dict (any other suffix);
`model.load_state_dict(load_weights(OUT), strict=True)` loads it. With `--hf` (the default for a
checkpoint of a transformers model when OUT has no suffix) OUT_DIR gets `config.json` and
safetensors weights that `AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads (tied weights
kept tied), and the files of the tokenizer the run trained with (kept in the checkpoints dir by
the CLI; `--tokenizer DIR` names another), so `AutoTokenizer.from_pretrained(OUT_DIR)` works too.
A checkpoint of an adapter run (`+adapter=lora`) keeps the adapter's config: `--adapter` writes
the adapter alone (`PeftModel.from_pretrained(base, OUT_DIR)`), `--hf` the base model with the
adapter merged in; both from the consolidated fp32 weights, so from any ZeRO stage.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from framework.backend import checkpoint_files, deepspeed_globals, expert_parallel
from framework.backend.weights import load_weights, save_weights
from framework.checkpoint import safety, store
from framework.checkpoint.staging import staged_dir, staged_file
from framework.errors import CheckpointError, ConfigError
from framework.integrations import hf, peft_files
from framework.integrations.hf import HF_CONFIG, HF_PREFIX, TOKENIZER_DIR
from framework.process.environment import choose_accelerator


def fp32_state_dict(ckpt: str | Path) -> dict[str, torch.Tensor]:
    """The full fp32 state dict of a checkpoint (a checkpoints dir or one checkpoint)."""
    path = store.resolve(str(ckpt), None, name=f"checkpoint {ckpt}")
    if path is None:
        raise ConfigError(f"no complete checkpoint in {ckpt}")
    meta = store.check(path)
    if int(meta.get("pipeline_stages", 1)) > 1:
        raise ConfigError(
            f"{path} is a pipeline checkpoint: export it from Python with Engine.save(path, training=False), "
            "which maps the stages back onto the model"
        )
    if expert_parallel.has_split_experts(meta.get("setup", {}).get("parameters", {})):
        raise ConfigError(
            f"{path} holds experts split over ranks (strategy.expert_parallel), which DeepSpeed's consolidation "
            "does not join: export it from Python with Engine.load(CKPT), then Engine.save(OUT, training=False)"
        )
    if _tp_size(path, meta) > 1:
        return _tensor_parallel_state_dict(path, meta)
    if int(meta["zero_stage"]) == 0:
        states = safety.load_safely(path / "mp_rank_00_model_states.pt")
        weights = {k: v.float() if v.is_floating_point() else v for k, v in states["module"].items()}
        return _with_fp32_masters(weights, states)
    return checkpoint_files.zero_fp32_state_dict(path.parent, path.name)


def _tp_size(path: Path, meta: dict) -> int:
    """The tensor-parallel degree a checkpoint was saved with (each TP rank writes model states)."""
    ranks = {
        re.search(r"mp_rank_(\d+)_model_states", f.name) for f in path.glob("*mp_rank_*_model_states.pt")
    }
    return int(meta.get("tp_size") or len({m.group(1) for m in ranks if m}) or 1)


def _tensor_parallel_state_dict(path: Path, meta: dict) -> dict[str, torch.Tensor]:
    """Whole fp32 weights of a tensor-parallel checkpoint, from its universal conversion: each
    parameter's `zero/<name>/fp32.pt`; buffers (never split) and the second names of tied
    weights from the first rank's model states, in its key order."""
    if int(meta["zero_stage"]) == 0:  # DeepSpeed's conversion reads ZeRO 1-3 checkpoints only
        return _merged_zero0_shards(path, _tp_size(path, meta))
    universal = store.to_universal(path)
    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt")  # ZeRO 1-2, 3
    states = safety.load_safely(next((path / n for n in names if (path / n).is_file()), path / names[0]))
    shared = dict(states.get("shared_params") or {})
    params = {name for group in states.get("param_shapes") or [] for name in group}
    out: dict[str, torch.Tensor] = {}
    for key, value in states["module"].items():
        whole = universal / "zero" / key / "fp32.pt"
        if key in shared:
            continue
        if key in params and not whole.is_file():
            raise CheckpointError(
                f"{universal} lacks the whole weight {key} (DeepSpeed's conversion left it out)"
            )
        out[key] = safety.load_safely(whole)["param"].float() if whole.is_file() else value
    for alias, source in shared.items():
        out[alias] = out[source]
    return {key: out[key] for key in states["module"]}


def _merged_zero0_shards(path: Path, tp: int) -> dict[str, torch.Tensor]:
    """A ZeRO-0 tensor-parallel checkpoint: each TP rank's model states hold its shard of every
    parameter (its fp32 masters beside them under mixed precision); the affine map AutoTP saved
    with them says which piece of the whole parameter each rank holds (DeepSpeed's own rebuild).
    An unsplit tensor must be the same on every rank."""
    ranks = [safety.load_safely(path / f"mp_rank_{r:02d}_model_states.pt") for r in range(tp)]
    shards = [
        _with_fp32_masters({k: v.float() if v.is_floating_point() else v for k, v in s["module"].items()}, s)
        for s in ranks
    ]
    maps = ((ranks[0].get("universal_checkpoint_info") or {}).get("affine_map") or {}).get("params") or {}
    shared = dict(ranks[0].get("shared_params") or {})
    out: dict[str, torch.Tensor] = {}
    for key in (k for k in shards[0] if k not in shared):
        entry = next((e for pattern, e in maps.items() if re.fullmatch(pattern, key)), None)
        if entry is not None:
            out[key] = checkpoint_files.rebuild_split(entry, {r: s[key] for r, s in enumerate(shards)})
        elif all(torch.equal(s[key], shards[0][key]) for s in shards):
            out[key] = shards[0][key]
        else:
            raise CheckpointError(
                f"{path}: {key} differs between tensor-parallel ranks and no map says how it is split"
            )
    out.update({alias: out[source] for alias, source in shared.items()})
    return {key: out[key] for key in shards[0]}


def save_hf_directory(
    ckpt: str | Path, out: str | Path, tokenizer: str | Path | None = None, base: str | Path | None = None
) -> Path:
    """A `save_pretrained` directory from a checkpoint of a transformers model (its config was
    saved with it): the model class from `config.architectures`, the fp32 weights, ties kept (an
    adapter run's: the base with the adapter merged in, see `save_adapter_directory` for `base`);
    the tokenizer's files from `tokenizer`, else from the checkpoints dir's `tokenizer/`. Written
    whole or not at all (`staging`)."""
    path = _checkpoint(ckpt)
    if tokenizer is not None and not Path(tokenizer).is_dir():
        raise ConfigError(f"--tokenizer {tokenizer}: no such directory")
    adapter = peft_files.load_config(path)
    model = peft_files.merged(_adapted(path, adapter, base, out)) if adapter is not None else _hf_model(path)
    with staged_dir(Path(out)) as staged:
        model.save_pretrained(str(staged), safe_serialization=True)
        generation = path / HF_CONFIG / "generation_config.json"
        if generation.is_file():
            (staged / "generation_config.json").write_text(generation.read_text())
        _copy_tokenizer(Path(tokenizer) if tokenizer else path.parent / TOKENIZER_DIR, staged)
    return Path(out)


def save_adapter_directory(ckpt: str | Path, out: str | Path, base: str | Path | None = None) -> Path:
    """A PEFT adapter directory (adapter_config.json, adapter_model.safetensors) from a checkpoint
    of an adapter run, whatever its ZeRO stage: `PeftModel.from_pretrained(base, OUT)` loads it.
    Such a checkpoint holds what trained; for a transformers model the frozen weights come from the
    base model's directory (`base`, else the one the adapter's config names) and the adapter is
    checked against them; for any other torch module the adapter's weights are written under the
    names peft gave them in training. Written whole or not at all (`staging`)."""
    path = _checkpoint(ckpt, transformers=False)
    adapter = peft_files.load_config(path)
    if adapter is None:
        raise ConfigError(
            f"{path} is not from an adapter run (+adapter=lora): export it with --hf or to a file"
        )
    if not (path / HF_CONFIG / "config.json").is_file():  # LoRA on a plain torch module
        state = fp32_state_dict(path)
        with staged_dir(Path(out)) as staged:
            peft_files.save_adapter_weights(path, state, staged)
        return Path(out)
    model = _adapted(path, adapter, base, out)
    with staged_dir(Path(out)) as staged:
        peft_files.save_adapter(model, staged)
    return Path(out)


def _checkpoint(ckpt: str | Path, transformers: bool = True) -> Path:
    """The checkpoint `ckpt` names (a checkpoints dir: its newest complete one), of a transformers
    model (or, not `transformers`, of any model)."""
    path = store.resolve(str(ckpt), None, name=f"checkpoint {ckpt}")
    if path is None:
        raise ConfigError(f"no complete checkpoint in {ckpt}")
    if transformers and not (path / HF_CONFIG / "config.json").is_file():
        raise ConfigError(
            f"{path} holds no Hugging Face config ({HF_CONFIG}/): --hf and --adapter export transformers models only"
        )
    return path


def _base(path: Path) -> Any:
    with torch.random.fork_rng(devices=[]):
        return hf.model_from_config_dir(path / HF_CONFIG)


def _adapted(path: Path, adapter: Any, base: str | Path | None, out: str | Path) -> Any:
    """The adapted model of an adapter run's checkpoint: what trained from its fp32 state, the
    frozen base from the base model's directory (`base` or the one the adapter names), which must
    be the base it trained on (its fingerprint, when the checkpoint records one) and is never
    written over (`out`)."""
    where = base or adapter.base_model_name_or_path
    if where is None or not Path(where).is_dir():
        named = (
            f"{where} (the adapter's base_model_name_or_path) is not a directory here"
            if where
            else "none is named"
        )
        raise ConfigError(
            f"{path} holds the adapter's weights only; its base model's weights are needed and {named}: "
            "add --base DIR (the save_pretrained directory the run trained from)"
        )
    if Path(out).resolve() == Path(where).resolve():
        raise ConfigError(
            f"{out} is the base model's own directory: the export would write over the base; choose another OUT"
        )
    problem = peft_files.other_base(store.read_meta(path).get("base"), Path(where))
    if problem:
        raise ConfigError(f"{path}: {problem}; give the base it was trained on with --base DIR")
    state = fp32_state_dict(path)
    if Path(where).resolve() != Path(str(adapter.base_model_name_or_path)).resolve():
        adapter.base_model_name_or_path = str(where)
    return peft_files.rebuilt(hf.pretrained(Path(where), _base(path)), adapter, state)


def _hf_model(path: Path) -> Any:
    """The transformers model of a checkpoint, its fp32 weights loaded, ties kept."""
    state = _hf_weights(path, fp32_state_dict(path))
    model = _base(path)
    architecture = type(model).__name__
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    if unexpected or [k for k in missing if k not in tied]:
        raise ConfigError(
            f"{path}: the weights do not fit {architecture} (missing {missing[:3]}, unexpected {unexpected[:3]})"
        )
    model.tie_weights()
    return model


def _copy_tokenizer(source: Path, out: Path) -> None:
    """The tokenizer's files next to the model's (none kept, none copied)."""
    if not source.is_dir():
        return
    for file in source.iterdir():
        if file.is_file() and file.name not in ("config.json", "model.safetensors"):
            shutil.copyfile(file, out / file.name)


def _hf_weights(path: Path, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF model's own weights: for a model trained inside a wrapper, those under its prefix,
    renamed; the wrapper's other weights have no place in a `save_pretrained` dir (said once)."""
    marker = path / HF_CONFIG / HF_PREFIX
    prefix = marker.read_text().strip() if marker.is_file() else ""
    if not prefix:
        return state
    left = [k for k in state if not k.startswith(prefix)]
    if left:
        print(
            f"export --hf: {len(left)} weights outside {prefix[:-1]!r} are not exported ({', '.join(left[:3])})"
        )
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def _with_fp32_masters(weights: dict[str, torch.Tensor], states: dict) -> dict[str, torch.Tensor]:
    """At ZeRO-0 under mixed precision the module's weights are bf16/fp16 and the optimizer's
    fp32 masters sit beside them, in parameter order (the module's keys without its buffers and
    without the second names of tied weights): export those when every shape matches."""
    optimizer = states.get("optimizer")
    groups = optimizer.get("fp32_groups") if isinstance(optimizer, dict) else None
    if not groups:
        return weights
    buffers = set(states.get("buffer_names") or [])
    aliases = set(states.get("shared_params") or {})
    names = [k for k in weights if k not in buffers and k not in aliases]
    masters = [m for group in groups for m in group]
    if len(names) == len(masters) and all(
        tuple(weights[n].shape) == tuple(m.shape) for n, m in zip(names, masters)
    ):
        weights.update({n: m.float() for n, m in zip(names, masters)})
        for alias, source in (states.get("shared_params") or {}).items():  # tied weights
            if source in weights:
                weights[alias] = weights[source]
    return weights


def main(argv: list[str] | None = None) -> int:
    """Command line: export CKPT_DIR to OUT."""
    parser = argparse.ArgumentParser(prog="python -m framework.export", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "checkpoint", help="a checkpoints dir (its newest complete checkpoint) or one checkpoint"
    )
    parser.add_argument("out", help="output file: .safetensors, or a torch state dict for any other suffix")
    parser.add_argument("--hf", action="store_true", help="write a Hugging Face save_pretrained directory")
    parser.add_argument(
        "--adapter", action="store_true", help="an adapter run's checkpoint: write a PEFT adapter directory"
    )
    parser.add_argument(
        "--base", help="an adapter run's base model directory (default: the one its config names)"
    )
    parser.add_argument(
        "--tokenizer", help="with --hf: the tokenizer dir to copy (default: the one the run kept)"
    )
    args = parser.parse_args(argv)
    deepspeed_globals.quiet(accelerator=choose_accelerator("auto"))  # before DeepSpeed's import says which
    try:
        if args.adapter:
            out = save_adapter_directory(args.checkpoint, args.out, args.base)
        elif args.hf or (not Path(args.out).suffix and _has_hf_config(args.checkpoint)):
            out = save_hf_directory(args.checkpoint, args.out, args.tokenizer, args.base)
        else:
            state = fp32_state_dict(args.checkpoint)
            with staged_file(Path(args.out)) as staged:
                save_weights(state, staged)
            out = Path(args.out)
    except (ConfigError, CheckpointError) as exc:
        print(f"Error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # the output cannot be made or written (a file on its path, a full disk, a limit)
        blocked = isinstance(exc, (FileExistsError, NotADirectoryError))
        why = f"{exc.filename} is a file, not a dir" if blocked else exc.strerror or str(exc)
        advice = "choose another path" if blocked else "free space or choose another path"
        print(f"Error: cannot write {args.out} ({why}); {advice}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _has_hf_config(ckpt: str) -> bool:
    path = store.resolve(ckpt, None, name=f"checkpoint {ckpt}")
    return path is not None and (path / HF_CONFIG / "config.json").is_file()


__all__ = [
    "fp32_state_dict",
    "load_weights",
    "main",
    "save_adapter_directory",
    "save_hf_directory",
    "save_weights",
]

if __name__ == "__main__":
    sys.exit(main())
