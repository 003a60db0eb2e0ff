"""The process: who this rank is, where it computes, how the job's processes started and stay alive.

Rule: imports nothing of the framework but `framework.errors`; never imports DeepSpeed, Hydra or
transformers. Every other package may import it.

* `context`      the `ProcessContext`: rank, world, local rank, accelerator, device, backend, the
                 default and the slow process group, small collectives, teardown;
* `environment`  what the launcher and the machine say before a context exists (ranks from the
                 environment, the accelerator choice, a free port);
* `launch`       starting a job's processes with well-known launchers (torch elastic, joining
                 torchrun / deepspeed / srun groups);
* `slurm`        Slurm's environment (node lists, requeued jobs, GPUs to request);
* `watchdog`     a rank that makes no progress ends the job with its stacks;
* `allocator`    glibc's thresholds for a CPU run.
"""
