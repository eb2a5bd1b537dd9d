"""Rollway: syncer — weight deltas through object storage, applied in place.

* ``syncer.publisher.WeightPublisher`` (trainer): state dict -> chunks + manifest in the
  store -> ``WeightVersion`` on ``rollway.weights``.
* ``syncer.subscriber.WeightSubscriber`` (sampler): follows ``rollway.weights``,
  prefetches and verifies, then ``await target.apply_weights(tensors, version)``.
* ``syncer.apply``: in-place apply into a torch module and a live vLLM model (the engine calls it).
* ``syncer.store``: ``file://`` and ``s3://`` object stores; ``syncer.catalog``: versions,
  update paths, retention; ``syncer.codec`` / ``syncer.tensor_codec``: XOR, byte
  planes, zstd, chunks, checksums; ``syncer.manifest``: the per-version manifest.

Nothing here is imported by ``import syncer``: torch and friends load on first use.
"""
