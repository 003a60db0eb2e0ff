"""Start-up footprint: resident memory after the imports a tiny LoRA fine-tune needs, and after
building it, ours next to TRL's stack.

Each side runs in a fresh process (`python -m benchmarks.footprint --side ours|trl`), alternated:
hydraspeed imports `framework`, `framework.methods.SFT`, transformers and peft, then builds an
`Engine` with `SFT()` and a LoRA adapter on a tiny Llama and prepares it for training (DeepSpeed
initialised, ZeRO-0, one process); TRL imports `trl`, transformers, peft and datasets, then builds
an `SFTTrainer` with the same model and adapter. Rows: RSS after the imports and after the build,
the ratio to TRL's measured in the same run (when TRL, the `bench` extra, is installed), and
whether mlflow, SciPy or scikit-learn were imported (none is used by either job).

    python -m benchmarks.footprint [--quick | --smoke]
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.common import median, parse_args, print_table, write

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("mlflow", "scipy", "sklearn")


def _rss_mb() -> float:
    """This process's resident memory now (Linux: /proc; elsewhere the peak)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _tiny_llama() -> Any:
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _lora() -> Any:
    import peft

    return peft.LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )


def ours() -> dict[str, Any]:
    """hydraspeed's imports, then an Engine with SFT and LoRA prepared for training."""
    import functools

    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from framework import Engine, Strategy
    from framework.methods import SFT

    imports = _rss_mb()
    engine = Engine(
        _tiny_llama(),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-4),
        train_step=SFT(),
        strategy=Strategy(sharding={"stage": 0}),
        adapter=_lora(),
    )
    engine.prepare("train", batch_size=2)
    built = _rss_mb()
    heavy = [m for m in HEAVY if m in sys.modules]
    engine.close()
    return {"imports_MB": imports, "built_MB": built, "heavy": heavy}


def trl() -> dict[str, Any]:
    """TRL's imports, then an SFTTrainer with the same model and adapter."""
    import datasets
    import peft  # noqa: F401
    import transformers
    import trl
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    imports = _rss_mb()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel({"<pad>": 0, "<unk>": 1}, unk_token="<unk>")), pad_token="<pad>"
    )
    rows = [{"input_ids": [2, 3, 4, 5], "labels": [-100, -100, 4, 5]}] * 4
    args = trl.SFTConfig(
        output_dir=os.environ.get("FOOTPRINT_TMP", "."),
        per_device_train_batch_size=2,
        max_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        dataset_kwargs={"skip_prepare_dataset": True},
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    trl.SFTTrainer(
        model=_tiny_llama(),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=_lora(),
    )
    built = _rss_mb()
    return {"imports_MB": imports, "built_MB": built, "heavy": [m for m in HEAVY if m in sys.modules]}


def measure(side: str, tmp: str) -> dict[str, Any]:
    """One side in a fresh process."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(OMP_NUM_THREADS="1", WANDB_MODE="disabled", FOOTPRINT_TMP=tmp, TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "benchmarks.footprint", "--side", side]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"{side} exited {run.returncode}:\n{run.stderr[-3000:]}")
    return dict(json.loads(run.stdout.strip().splitlines()[-1]))


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Alternate the sides and write results/footprint.json."""
    if argv is None and "--side" in sys.argv:
        side = sys.argv[sys.argv.index("--side") + 1]
        print(json.dumps(ours() if side == "ours" else trl()))
        return []
    import tempfile

    args = parse_args(__doc__, argv)
    repeats = 1 if args.smoke else 3 if args.quick else 5
    sides = ["ours", "trl"] if importlib.util.find_spec("trl") else ["ours"]
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(repeats):
            for side in sides:
                runs[side].append(measure(side, tmp))
    rows = []
    for stage in ("imports", "built"):
        value = {s: median([r[f"{stage}_MB"] for r in runs[s]]) for s in sides}
        for side in sides:
            rows.append(
                {
                    "stage": "after imports" if stage == "imports" else "after building the run",
                    "framework": "hydraspeed" if side == "ours" else "TRL",
                    "rss_MB": round(value[side], 1),
                    "ours_over_trl": round(value["ours"] / value["trl"], 3) if "trl" in value else None,
                    "imported": ", ".join(runs[side][-1]["heavy"]) or "-",
                }
            )
    print_table("Resident memory of a tiny LoRA run (MB, medians)", rows)
    notes = {"target": "ours_over_trl <= 1.05 after building", "repeats": repeats, "heavy": list(HEAVY)}
    write("footprint", rows, notes, args.out_dir)
    return rows


if __name__ == "__main__":
    main()
