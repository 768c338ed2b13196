"""Single-direction transfer handlers over the device runtime.

Runs in: worker processes (the native, simple and recompute offload paths all copy through here).

One `DirectionHandler` owns one dedicated stream. ``transfer_async`` builds the job's descriptors
(adjacent runs coalesced, at most 4096 per native call), and enqueues on that stream:
for a store, a wait on the submitting thread's current (compute) stream first, so a store never
reads a block before the model wrote it; then a start event, the batched copy and an end event.
One stream per direction means jobs complete in submission order, so `get_finished` pops from the
head while the head's end event has fired.

Failures: a copy that fails at descriptor k marks that job failed, with its device block ids
and k. The stream keeps only its first sticky error until it is consumed (when the handler has
nothing in flight), so a job completing while that error is pending cannot show a failure of its
own: it is reported failed too (its copies are unproven), never as a success. Nothing else is
touched. A copy call the runtime
refuses (raises) is not raised to the submitter: the job is enqueued anyway (its end event after
whatever part of the batch was accepted) and reported failed in its turn.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ascend_dist.common.blocks import BlockIds, validate_block_ids
from ascend_dist.common.device import CopyDirection, DeviceRuntime, Event, Stream
from ascend_dist.common.errors import AscendDistError, ConfigError, DeadlineExceeded, format_allowed
from ascend_dist.kv_offload.chunk_descriptors import ChunkRef, Direction, build_chunk_descriptors

__all__ = ["DEFAULT_WAIT_S", "DirectionHandler", "TransferResult"]

logger = logging.getLogger(__name__)

DEFAULT_WAIT_S = 60.0
"""Deadline of `DirectionHandler.wait` and `DirectionHandler.shutdown` unless given."""


@dataclass(frozen=True)
class TransferResult:
    """The outcome of one job.

    Attributes:
        job_id: the id given to ``transfer_async``.
        success: False when a copy of this job failed.
        transfer_size: bytes the job copies.
        transfer_time: seconds between its start and end events (None when it failed).
        failed_block_ids: the job's device block ids when it failed (loads: recompute these).
        failed_descriptor: index of the failing descriptor within the job, when known.
        error: text of the failure.
        num_descriptors: copy descriptors the job submitted (after coalescing; 0 when it failed).
    """

    job_id: int
    success: bool
    transfer_size: int
    transfer_time: float | None = None
    failed_block_ids: tuple[int, ...] = ()
    failed_descriptor: int | None = None
    error: str | None = None
    num_descriptors: int = 0


@dataclass
class _Job:
    job_id: int
    device_block_ids: tuple[int, ...]
    num_bytes: int
    num_descriptors: int
    start: Event
    end: Event
    error: AscendDistError | None = field(default=None)


class DirectionHandler:
    """Device<->host copies of one direction on one dedicated stream, completed in order."""

    def __init__(
        self,
        runtime: DeviceRuntime,
        refs_per_group: Sequence[Sequence[ChunkRef]],
        *,
        direction: Direction,
        blocks_per_chunk: int = 1,
        coalesce: bool = True,
        num_host_chunks: int | None = None,
        num_device_blocks: int | None = None,
    ) -> None:
        """Create the handler and its stream.

        Args:
            runtime: the device runtime.
            refs_per_group: per KV-cache group, the canonical tensors (device and host geometry).
            direction: ``"store"`` (device -> host) or ``"load"`` (host -> device).
            blocks_per_chunk: device blocks per host chunk.
            coalesce: merge adjacent runs into one descriptor.
            num_host_chunks: rows of the host allocation: a job naming a host id at or past it
                is refused (`BlockIdError`), never copied; None: unchecked.
            num_device_blocks: blocks of the device cache, checked the same way.

        Raises:
            ConfigError: bad direction, no group, a group without refs, or a bad factor.
        """
        if direction not in ("store", "load"):
            raise ConfigError("direction", direction, format_allowed(("store", "load")))
        if not refs_per_group or not all(refs_per_group):
            raise ConfigError("refs_per_group", len(refs_per_group), "at least one group, each with refs")
        if blocks_per_chunk < 1:
            raise ConfigError("blocks_per_chunk", blocks_per_chunk, "a positive integer")
        self.direction: Direction = direction
        self._runtime = runtime
        self._refs = [list(g) for g in refs_per_group]  # own copy: shutting one handler down keeps the other's
        self._k = blocks_per_chunk
        self._coalesce = coalesce
        self._num_host_chunks = num_host_chunks
        self._num_device_blocks = num_device_blocks
        self._copy_direction = CopyDirection.D2H if direction == "store" else CopyDirection.H2D
        self.stream: Stream = runtime.new_stream(priority=-1)
        self._lock = threading.Lock()
        self._jobs: deque[_Job] = deque()
        self._by_id: dict[int, _Job] = {}
        self._attributed: set[int] = set()  # id() of sticky errors already charged to a job
        self._closed = False
        self.descriptors_submitted = 0
        self.blocks_submitted = 0

    @property
    def runtime(self) -> DeviceRuntime:
        """The device runtime this handler copies on."""
        return self._runtime

    def transfer_async(
        self,
        job_id: int,
        device_block_ids: BlockIds,
        host_chunk_ids: BlockIds,
        *,
        group_sizes: Sequence[int] | None = None,
        block_indices: Sequence[int] | None = None,
        after: Event | None = None,
    ) -> bool:
        """Enqueue one job; returns at once (True).

        A store waits for the submitting thread's current (compute) stream, or for ``after`` when
        given (an event the caller recorded on the compute stream, e.g. from another thread).

        Raises:
            BlockIdError: a host or device id outside its allocation, or malformed ids (nothing enqueued).
            ConfigError: a duplicate job id, bad geometry (nothing enqueued), or a closed handler.
        """
        if self._closed:
            raise ConfigError("handler", self.direction, "an open handler (it was shut down)")
        device = validate_block_ids(device_block_ids, field="device_block_ids", num_blocks=self._num_device_blocks)
        desc = build_chunk_descriptors(
            self._refs,
            device,
            host_chunk_ids,
            blocks_per_chunk=self._k,
            direction=self.direction,
            group_sizes=group_sizes,
            block_indices=block_indices,
            coalesce=self._coalesce,
            num_host_chunks=self._num_host_chunks,
            num_device_blocks=self._num_device_blocks,
        )
        with self._lock:
            if self._closed:
                raise ConfigError("handler", self.direction, "an open handler (it was shut down)")
            if job_id in self._by_id:
                raise ConfigError("job_id", job_id, "an id not already in flight")
            compute = self._runtime.current_stream()
            start = self._runtime.new_event(timing=True)
            end = self._runtime.new_event(timing=True)
            if after is not None:
                self.stream.wait_event(after)
            elif self.direction == "store" and compute is not self.stream:
                self.stream.wait_stream(compute)  # KV writes of the model finish before D2H reads them
            start.record(self.stream)
            refused: AscendDistError | None = None
            if len(desc):
                try:
                    self._runtime.batch_copy(desc.src, desc.dst, desc.sizes, self._copy_direction, stream=self.stream)
                except AscendDistError as exc:  # part of the batch may be enqueued: the job fails after it ran
                    refused = exc
            end.record(self.stream)
            job = _Job(job_id, tuple(device.tolist()), desc.total_bytes, len(desc), start, end, refused)
            self._jobs.append(job)
            self._by_id[job_id] = job
            self.descriptors_submitted += len(desc)
            self.blocks_submitted += int(device.size)
        return True

    def pending(self) -> list[int]:
        """Job ids submitted and not yet reported by `get_finished`, in order."""
        with self._lock:
            return [job.job_id for job in self._jobs]

    def get_finished(self) -> list[TransferResult]:
        """Pop and report every job at the head whose end event has fired (submission order)."""
        results: list[TransferResult] = []
        with self._lock:
            while self._jobs and self._jobs[0].end.query():
                job = self._jobs.popleft()
                del self._by_id[job.job_id]
                results.append(self._result(job))
            if not self._jobs and self._attributed:
                self._clear_sticky()
        return results

    def _result(self, job: _Job) -> TransferResult:
        """Turn a completed job into its result, charging a new sticky error to this job only."""
        if job.error is not None:  # the copy call itself was refused
            logger.warning("%s job %s failed at submission: %s", self.direction, job.job_id, job.error)
            return TransferResult(job.job_id, False, job.num_bytes, None, job.device_block_ids, None, str(job.error))
        try:
            job.end.synchronize(timeout=0.0)
        except DeadlineExceeded:
            raise
        except AscendDistError as exc:
            if id(exc) not in self._attributed:
                self._attributed.add(id(exc))
                index = getattr(exc, "index", None)
                logger.warning("%s job %s failed: %s", self.direction, job.job_id, exc)
                return TransferResult(
                    job.job_id, False, job.num_bytes, None, job.device_block_ids,
                    None if index is None else int(index), str(exc),
                )  # fmt: skip
            # The stream keeps only its first sticky error: a failure of this job's own copies
            # would be hidden behind it, so its bytes are unproven and it is not reported a success.
            logger.warning(
                "%s job %s completed behind an earlier copy error: reported failed", self.direction, job.job_id
            )
            return TransferResult(
                job.job_id, False, job.num_bytes, None, job.device_block_ids, None,
                f"completed while the stream still held an earlier copy error ({exc}): its copies are unproven",
            )  # fmt: skip
        seconds = job.start.elapsed_ms(job.end) / 1000.0
        return TransferResult(job.job_id, True, job.num_bytes, seconds, num_descriptors=job.num_descriptors)

    def _clear_sticky(self) -> None:
        """The stream is idle: consume its sticky error so a later failure is seen afresh."""
        try:
            self.stream.synchronize(timeout=0.0)
        except DeadlineExceeded:
            return
        except AscendDistError:
            pass
        self._attributed.clear()

    def wait(self, job_ids: Iterable[int], timeout: float = DEFAULT_WAIT_S) -> None:
        """Block until each known job's end event has fired; unknown ids are ignored.

        Failures are not raised here: `get_finished` reports them.

        Raises:
            DeadlineExceeded: a job did not finish within ``timeout`` seconds.
        """
        with self._lock:
            ends = [self._by_id[j].end for j in job_ids if j in self._by_id]
        for end in ends:
            try:
                end.synchronize(timeout=timeout)
            except DeadlineExceeded:
                raise
            except AscendDistError:
                pass

    def fence(self, job_ids: Iterable[int], stream: Stream | None = None) -> int:
        """Make ``stream`` (default: the current stream) wait for the given jobs without blocking.

        Work enqueued on that stream afterwards (e.g. the model overwriting a reused block) runs only
        once these jobs' copies are done. Unknown ids are ignored.

        Returns:
            How many jobs the stream now waits for.
        """
        target = self._runtime.current_stream() if stream is None else stream
        with self._lock:
            ends = [self._by_id[j].end for j in job_ids if j in self._by_id]
        for end in ends:
            target.wait_event(end)
        return len(ends)

    def shutdown(self, timeout: float = DEFAULT_WAIT_S) -> list[TransferResult]:
        """Refuse new jobs, wait for the in-flight ones and report them; idempotent.

        Raises:
            DeadlineExceeded: in-flight jobs did not finish within ``timeout`` seconds.
        """
        with self._lock:
            self._closed = True
            ids = [job.job_id for job in self._jobs]
        self.wait(ids, timeout)
        results = self.get_finished()
        self._refs = []
        return results
