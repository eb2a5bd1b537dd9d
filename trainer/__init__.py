"""Rollway: trainer.

Reads trajectories and rewards from Kafka, forms groups, trains off-policy with
sampling distribution replay and importance sampling, logs every step so it can be
re-executed bit for bit, checkpoints, and publishes weights through the syncer.

Modules, in the order data flows through them:

* ``trajectory`` -- chunks + reward -> a checked ``Trajectory``; ``Group``
* ``assembler``  -- the live stream -> groups ready to train (dedup, staleness, version cap)
* ``packing``    -- groups -> tensors per micro-batch
* ``loss``       -- advantages, replayed log-probs, IS/TIS/clip, diagnostics (pure functions)
* ``core``       -- model + Muon/AdamW + one deterministic step -> weights hash, metrics
* ``steplog``    -- the ``train-steps`` topic: write, read, rebuild a step's groups
* ``replay``     -- re-execute logged steps from a checkpoint, compare hashes
* ``checkpoint`` -- asynchronous, atomic checkpoints
* ``publishing`` -- the weight sink interface and the syncer behind it
* ``service``    -- the trainer process: restore, replay, train live

Tests build trajectories with ``tests/synthetic.py``: plain-torch rollouts encoded by the
samplers' own ``TrajectoryRecorder``.
"""
