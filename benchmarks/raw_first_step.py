"""The reference for the time-to-first-step benchmark: a hand-written DeepSpeed script that
trains the same MLP on the same digits data for one optimizer step and exits."""

import os
import socket

if __name__ == "__main__":
    import torch

    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }.items():
        os.environ.setdefault(key, value)

    import deepspeed
    from sklearn.datasets import load_digits
    from torch import nn

    digits = load_digits()
    x = torch.tensor(digits.data[:64], dtype=torch.float32) / 16
    y = torch.tensor(digits.target[:64])
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
        config={"train_batch_size": 64, "zero_optimization": {"stage": 0}, "steps_per_print": None},
    )
    x, y = x.to(engine.device), y.to(engine.device)
    loss = nn.functional.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
    print(f"loss {loss.item():.4f}", flush=True)
    torch.distributed.destroy_process_group()
    # Leave at once: a C++ thread left by the process group can abort the interpreter's teardown
    # (SIGABRT after the step succeeded, seen once in a full test run); the teardown is ~10 ms.
    os._exit(0)
