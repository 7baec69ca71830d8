"""What a ZeroOptimizer holds and moves: bytes of parameters, gradients and
state, collective traffic, the NVMe swap spaces. Read-only views of the C++
core's counters, mixed into :class:`zeroshard.ZeroOptimizer`."""

from __future__ import annotations

from typing import Any


class OptimizerMeasurements:
    """Counters of the C++ optimizer ``self._impl``."""

    _impl: Any

    def parameter_bytes(self) -> int:
        """Bytes of parameter storage held now: shards plus gathered buffers."""
        return int(self._impl.parameter_bytes())

    def gathered_parameter_bytes(self) -> int:
        """Bytes of full-size parameter buffers held now (stage 3: gathered units)."""
        return int(self._impl.gathered_parameter_bytes())

    def peak_gathered_parameter_bytes(self) -> int:
        """Largest ``gathered_parameter_bytes()`` since the last reset."""
        return int(self._impl.peak_gathered_parameter_bytes())

    def reset_peak_gathered_parameter_bytes(self) -> None:
        """Restarts peak tracking of the gathered parameter buffers."""
        self._impl.reset_peak_gathered_parameter_bytes()

    def device_model_state_bytes(self) -> int:
        """Bytes of parameters, gradients and optimizer state on the training device."""
        return int(self._impl.device_model_state_bytes())

    def host_model_state_bytes(self) -> int:
        """Bytes of model state offloaded to host memory.

        Optimizer state and its staging, parameter shards (``offload_param``)
        and the gradient shard when every sub-group is offloaded."""
        return int(self._impl.host_model_state_bytes())

    def nvme_stats(self) -> dict[str, Any] | None:
        """The NVMe swap spaces since construction; None without NVMe offload.

        With ``offload_optimizer`` on NVMe: ``backend`` (``"io_uring"`` or
        ``"thread pool"``), ``directory``, ``disk_bytes`` reserved,
        ``buffer_bytes`` of host buffers, ``bytes_read``, ``bytes_written`` and
        ``io_wait_seconds`` (time the step waited for I/O). With
        ``offload_param`` on NVMe, under ``"parameters"``: the same I/O keys,
        ``host_shard_bytes`` (shards kept in host memory: ``max_in_cpu`` and
        persistent ones), ``ahead_bytes`` / ``peak_ahead_bytes`` (read-ahead
        buffers now / at most), ``reads_ahead`` (reads the read-ahead served)
        and ``reads_on_demand`` (reads that waited for the disk). With
        ``offload_optimizer.swap_gradients``, under ``"gradients"``:
        ``directory``, ``disk_bytes``, ``buffer_bytes`` / ``peak_buffer_bytes``
        (gradient blocks in host memory now / at most) and the I/O keys."""
        return self._impl.nvme_stats()

    def optimizer_state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (fp32 master + inner state)."""
        return int(self._impl.optimizer_state_bytes())

    def gradient_bytes(self) -> int:
        """Bytes of gradients held now on the training device.

        The gradient shard, live staging buffers and any ``.grad``; a gradient
        shard offloaded to host memory counts in ``host_gradient_bytes`` (and
        ``host_model_state_bytes``)."""
        return int(self._impl.gradient_bytes())

    def host_gradient_bytes(self) -> int:
        """Bytes of the gradient shard held in host memory (offload with every
        sub-group offloaded; 0 otherwise)."""
        return int(self._impl.host_gradient_bytes())

    def peak_staging_bytes(self) -> int:
        """Largest gradient staging footprint since the last reset."""
        return int(self._impl.peak_staging_bytes())

    def cached_buffer_bytes(self) -> int:
        """Host buffers kept from one step to the next for reuse (gradient
        staging, reduce-scatter outputs and receive rows), at most one step's peak."""
        return int(self._impl.cached_buffer_bytes())

    def release_cached_buffers(self) -> int:
        """Unmaps the buffers :meth:`cached_buffer_bytes` counts, as
        ``torch.cuda.empty_cache`` does for CUDA's cache, e.g. before an
        evaluation that needs the memory; the next step maps afresh. Returns
        the bytes given back. Local to this rank: no collective."""
        return int(self._impl.release_cached_buffers())

    def reset_peak_staging_bytes(self) -> None:
        """Restarts peak tracking of the gradient staging buffers."""
        self._impl.reset_peak_staging_bytes()

    def comm_stats(self) -> dict[str, float]:
        """Collectives since construction or the last :meth:`reset_comm_stats`:
        ``*_bytes`` and ``total_bytes`` count whole buffers (a reduce-scatter's
        input, an all-gather's output); ``wire_bytes`` what this rank sends, by
        the ring algorithms' count (B(N-1)/N of a buffer of B bytes on N ranks,
        twice that for an all-reduce); ``calls``; ``wait_seconds`` blocked."""
        return dict(self._impl.comm_stats())

    def replica_comm_stats(self) -> dict[str, float]:
        """Hybrid sharding: bytes handed to collectives across replicas (zeros without)."""
        return dict(self._impl.replica_comm_stats())

    def reset_comm_stats(self) -> None:
        """Zeroes what :meth:`comm_stats` reports. The engine's telemetry keeps
        counters of its own: a reset changes nothing in it."""
        self._impl.reset_comm_stats()

    def host_sync_counts(self) -> dict[str, int]:
        """How often this optimizer made the host wait for the device since
        construction, by reason (``"step_flags"``, ``"clip_coefficient"``,
        ``"host_data_on_device"``, ``"offload_gradient_copy"``,
        ``"offload_update"``, ``"pageable_copy"``, ``"telemetry"``,
        ``"checkpoint"``; reasons never counted are left out).

        Counted whatever the device, so a CPU run shows what the same run pays
        on a GPU (see docs/gpu.md). After warm-up a step costs at most 2 at
        every stage, none per unit or per bucket."""
        return dict(self._impl.host_sync_counts())

    def set_host_channel(self, group: Any) -> None:
        """The group the shard group's host knowledge (agreements, flags, error
        messages) travels over: a Gloo group over the same ranks in the same
        order. ZeroOptimizer gives NCCL groups one by itself (a Gloo backend
        for CPU tensors, see ``zeroshard.host_channel``); this is for a group
        of your own. ``None`` sends host data through the device, each
        exchange a host sync (what a channel saves, measurable on CPU). Call
        it on every rank alike, between steps."""
        self._impl.set_host_channel(group)

    def set_event_log_enabled(self, enabled: bool) -> None:
        """Records every collective launch and wait while enabled."""
        self._impl.set_event_log_enabled(enabled)

    def retired_work_count(self) -> int:
        """Frees finished collectives the backend let go of; returns how many it still holds."""
        return int(self._impl.retired_work_count())

    def event_log(self) -> list[tuple[str, str, int, str]]:
        """(event, collective, bytes, tag) in issue order."""
        return list(self._impl.event_log())
