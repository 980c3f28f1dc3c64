"""The parallel wiring of a whole model: `ddp` (DistributedDataParallel and its communication hooks), `fsdp`
(FSDP2, per block), `zero` (ZeRO-1, the optimizer state sharded over ranks) and `powersgd_state` (PowerSGD's
error feedback, checkpointable). Each takes plain values, not the training configuration."""
