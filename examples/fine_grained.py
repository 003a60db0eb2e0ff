"""Own the loop: Engine.dataloader -> prepare -> run, on the digits data.

python examples/fine_grained.py --stage 3
torchrun --nproc-per-node=2 examples/fine_grained.py --stage 3
"""

import argparse
import functools
import json

import torch
import torchmetrics

from framework import Engine, Strategy
from framework.data.datasets import digits
from framework.models import MLP


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--stage", type=int, default=0, help="ZeRO stage")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch")
    parser.add_argument("--out", help="write the final metrics here as JSON")
    args = parser.parse_args()

    torch.manual_seed(0)
    train, valid = digits()
    engine = Engine(
        MLP(),
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.AdamW, lr=3e-3),
        torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro"),
        strategy=Strategy(sharding={"stage": args.stage}),
    )
    loader = engine.dataloader(
        train, batch_size=args.batch_size, shuffle=True, epochs=args.epochs, mode="train"
    )
    engine.prepare(mode="train")
    for step, batch in enumerate(loader):
        logs = engine.run(batch, mode="train", fetch_list=["lr"])
        if step % 50 == 0 and engine.process.is_main:
            print(f"step {step} loss {logs['loss']:.4f} lr {logs['fetches']['lr']:.2e}")

    valid_loader = engine.dataloader(valid, batch_size=args.batch_size, mode="eval")
    engine.reset_metrics()
    losses = [engine.run(batch, mode="eval") for batch in valid_loader]
    result = {
        "val_accuracy": losses[-1]["accuracy"],
        "steps": engine.runtime.global_steps,
    }
    if engine.process.is_main:
        print(f"validation accuracy {result['val_accuracy']:.4f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    engine.close()  # the process group goes (also at exit, when a script does not say so)


if __name__ == "__main__":
    main()
