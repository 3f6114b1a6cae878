"""The weight hand-over: a policy version goes from the actor's live model into a rollout engine, in memory,
in compute-dtype buckets of bounded size (no second full copy of the model, no file on the way).

Modules, bottom up (each imports only those above it):

- `buckets`: the tensors of a live model (`compute_tensors`) packed into flat byte buffers (`pack_buckets`,
  `PackPlan` for one version after another of the same model) and unpacked on the other side (`unpack_bucket`).
- `versions`: a published version in the two forms an engine loads besides a stream: `InMemoryWeights` (the
  live model of the actor in the same process) and a stored copy's files (`copy_files`, `write_copy`).
- `trace`: the RLHF_WEIGHTS_TRACE=1 lines both sides write (bench/weights_trace.py lines them up).
- `channel`: the primitives between processes: where a sender listens (`Channel`, a TCPStore), process
  groups made over it (NCCL or gloo), a bucket's payload as plain data and its opening on the receiving side
  (`open_payload`: a CUDA IPC handle, a broadcast of a group, or bytes).
- `sender`: the actor's side and the protocol (its docstring): `WeightSender` answers pulls with its live
  weights, from a thread (`publish`) or from every rank of a sharded actor (`serve`).
- `receiver`: the rollout's side: `RemoteWeights`, a version pulled through the actor's channel into an
  engine, and `Loader`, what that engine offers; `abort`, the driver giving a hand-over up.
- `vllm_worker`: the code vLLM's worker processes run (its `worker_extension_cls`, given by dotted path:
  "components.weight_sync.vllm_worker.WeightReceiver"), called by name through `collective_rpc`.

Which transport uses which (storage, memory in one process, a stream between workers) is the runtime's
choice (flows/runtime/weights/); nothing here knows about stages or the run folder.

How a new rollout engine plugs in. Its `load_weights(source)` takes one of three sources:
- a path (str): a stored copy, a Hugging Face safetensors folder; load it in place;
- an `InMemoryWeights` (`trainer.execution=local`): iterate `source.tensors()` (raises StaleWeightsError once
  the actor moved on, before anything is loaded) and copy the tensors in, or pack them with `pack_buckets` and
  hand each bucket to the engine's own processes, as VLLMRolloutEngine does;
- a `RemoteWeights` (`trainer.execution=workers`): call `source.receive_into(self)`, which drives the
  engine through the `receiver.Loader` protocol:
  `weight_session` (a string naming the engine to the sender, e.g. `receiver.new_session()`),
  `describe_loaders()` ({"device": "cuda" | "cpu", "gpus": the GPU uuids every loading process sees,
  "loaders": how many processes load}: the sender picks CUDA IPC or a group from it),
  `join_weight_group(channel, prefix, first_rank, world, backend, timeout_s)` (every loading process joins,
  e.g. with `channel.GroupReceiver`), `begin_load()`, `load_bucket(specs, payload)` (open it with
  `channel.open_payload`, unpack with `buckets.unpack_bucket`, and be done with it on return: the sender
  reuses its buffer for the next bucket), `finish_load()`.
HFRolloutEngine (components/rollout.py) is the smallest complete receiver. An engine may report the parts
of its last load in `last_metrics` under `receiver.LOAD_PARTS`.
"""
