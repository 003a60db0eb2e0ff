"""DeepSpeed, and everything that touches it: the only package that imports `deepspeed`.

Rule: imports `framework.errors`, `framework.process`, `framework.integrations`,
`framework.plan` and `framework.data`; nothing above it. DeepSpeed is imported inside functions
(importing the framework never imports DeepSpeed, which fixes its accelerator when first imported).

* `runtime`           the one owner of DeepSpeed's engine (building it, forward, backward, step,
                      a frozen reference laid out as the trained model);
* `runtime_state`     what that engine holds, in and out: checkpoint files, whole weights;
* `topology`          where a runtime runs and how its batch splits: the process context, the
                      mesh, the batch layout (fixed by the first training call);
* `ds_config`         Strategy + layout + model sizes -> DeepSpeed's config dict (the only module
                      that knows its keys);
* `deepspeed_globals` DeepSpeed's process-wide state kept in step (its accelerator, its groups);
* `pipeline`, `recompute`, `placement`, `zero3_trace`: the pipeline engine, activation
                      checkpointing, offload and device placement, ZeRO-3's trace;
* `parallel`, `sequence_parallel`, `expert_parallel`: TP / SP / EP wiring (AutoTP, Ulysses, AutoEP);
* `weights`           whole weights in and out of a partitioned model;
* `generation`        the trained model whole for a rollout (ZeRO-3: gathered once, hooks off);
* `head`              a loss that applies the output head itself, run as the model's and the
                      head's forward (ZeRO-3 gathers the head once per pass, not per chunk);
* `checkpoint_files`  DeepSpeed's own checkpoint readers (zero_to_fp32, universal conversion);
* `estimate`          per-rank model-state bytes under the mesh, and DeepSpeed's estimators.
"""
