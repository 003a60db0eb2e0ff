"""to_static / DistModel: call the model, get a training step. Data through shard_dataloader.

python examples/dist_model.py --stage 3
torchrun --nproc-per-node=2 examples/dist_model.py --stage 3
"""

import argparse
import functools
import json

import torch
import torchmetrics
from torch.utils.data import DataLoader

from framework import Strategy, shard_dataloader, to_static
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
    # An ordinary DataLoader; shard_dataloader gives each rank its share, on the device.
    train_loader = shard_dataloader(
        DataLoader(train, batch_size=args.batch_size, shuffle=True), epochs=args.epochs
    )
    valid_loader = shard_dataloader(DataLoader(valid, batch_size=args.batch_size))
    accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=10, average="micro")

    dm = to_static(
        MLP(),
        train_loader,
        torch.nn.CrossEntropyLoss(),
        functools.partial(torch.optim.AdamW, lr=3e-3),
        Strategy(sharding={"stage": args.stage}),
        metrics=accuracy,
    )
    dm.train()
    for step, (x, y) in enumerate(train_loader):
        loss = dm(x, y)
        if step % 50 == 0 and dm.engine.process.is_main:
            print(f"step {step} loss {float(loss):.4f}")

    dm.eval()
    dm.engine.reset_metrics()
    val_losses = [float(dm(x, y)) for x, y in valid_loader]
    result = {
        "val_accuracy": dm.engine.metrics.eval.compute()["accuracy"],
        "val_loss": sum(val_losses) / len(val_losses),
    }

    dm.predict()
    x, _ = next(iter(valid_loader))
    assert dm(x).shape == (x.shape[0], 10)
    if dm.engine.process.is_main:
        print(f"validation accuracy {result['val_accuracy']:.4f}")
        if args.out:
            with open(args.out, "w") as f:
                json.dump(result, f)
    dm.engine.close()  # the process group goes (also at exit, when a script does not say so)


if __name__ == "__main__":
    main()
