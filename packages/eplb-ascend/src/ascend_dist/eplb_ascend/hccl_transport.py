"""The device transport built from a real `PyHcclCommunicator`: expert bytes on its stream, control on gloo.

Runs in: the worker. `hccl_transport` connects the `RendezvousTransport` seam to
``ascend_dist.hccl_ctypes.PyHcclCommunicator`` (HCCL on Ascend, NCCL on CUDA, gloo on the CPU
simulation): sends and receives are enqueued on one stream of the communicator's device runtime in
the deadlock-free `rendezvous_order`; a batch is complete when that stream synchronizes, which is
waited with the batch's deadline (`TransferTimeout` past it). A failure the stream reports (a
collective error, a timed-out engine operation) becomes `TransferError` / `TransferTimeout`, so the
mover votes "no" and every rank keeps its old placement.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ascend_dist.common.errors import AscendDistError, ConfigError, DeadlineExceeded, TransferError
from ascend_dist.eplb_ascend.transport import P2PTransport, RendezvousTransport

if TYPE_CHECKING:
    from ascend_dist.common.device import DeviceRuntime, Stream
    from ascend_dist.hccl_ctypes.communicator import PyHcclCommunicator

__all__ = ["hccl_transport"]


def hccl_transport(
    communicator: PyHcclCommunicator,
    control: P2PTransport,
    *,
    runtime: DeviceRuntime | None = None,
    stream: Stream | None = None,
) -> RendezvousTransport:
    """A `P2PTransport` whose expert bytes travel over ``communicator``.

    Args:
        communicator: An enabled `PyHcclCommunicator` over the EP group (group-local ranks).
        control: The CPU control transport of the same group (a `GlooTransport` on the EP
            coordinator's ``cpu_group``): fingerprints and commit votes.
        runtime: The device runtime the communicator enqueues on; None: the communicator's own.
        stream: The stream to enqueue the transfers on; None: the runtime's current stream (taken now).

    Returns:
        A `RendezvousTransport` whose ``synchronize(timeout_s)`` waits for ``stream`` with that deadline.

    Raises:
        ConfigError: The communicator is disabled (world size 1 or no library), or its ranks
            disagree with ``control``'s.
    """
    if communicator.disabled:
        raise ConfigError(
            "communicator", f"disabled ({communicator.disabled_reason})", "an enabled communicator (library or gloo)"
        )
    rt = runtime if runtime is not None else communicator.runtime
    target = stream if stream is not None else rt.current_stream()

    def synchronize(timeout_s: float) -> None:
        try:
            target.synchronize(timeout_s)
        except DeadlineExceeded:
            raise  # the transport reports it as TransferTimeout
        except AscendDistError as exc:  # sticky error of an op on the stream (CollectiveError, DeviceError)
            raise TransferError(f"expert transfer failed on the device stream: {exc}") from exc

    return RendezvousTransport(communicator, control, synchronize, target)
