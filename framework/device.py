"""Removed after 0.1.0: its functions became methods of `framework.ProcessContext` (importing this says so in one line)."""

raise ImportError(
    "framework.device was removed after 0.1.0: its functions are methods of framework.ProcessContext now (ctx = ProcessContext.start(); ctx.rank, ctx.world_size, ctx.device, ctx.barrier(), ctx.close(); an engine's: engine.process); see docs/concepts/process-context.md"
)
