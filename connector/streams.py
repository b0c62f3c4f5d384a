"""Where a worker's copies run relative to the model runner's forward.

On the CPU backend copies are memcpys on the calling thread: nothing to order. On CUDA they run
on a side stream that must start after the KV writes the forward has queued, and each attention
layer must wait for its own layer's load. The stream to order after is the one the *model
runner* computes on, captured on its thread (``bind_compute``), not the current stream of the
thread that issues the copies: layer-wise loads are issued from the ``kvtier-load`` thread,
whose current stream is the device's default stream, while vLLM may compute on another one.

``DeviceOrdering`` takes the CUDA API as ``backend`` (``torch.cuda``) so tests can check the
ordering with a recording stand-in on machines without a GPU.

Threading: ``bind_compute`` and ``wait_layer`` on the model-runner thread; ``copying`` and
``layer_loaded`` on whichever thread copies.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


class HostOrdering:
    """CPU backend: copies complete on the calling thread; nothing to wait for."""

    def bind_compute(self) -> None:
        return None

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        yield

    def layer_loaded(self, layer: int) -> None:
        return None

    def wait_layer(self, layer: int) -> None:
        return None

    def synchronize(self) -> None:
        return None


class DeviceOrdering:
    """CUDA: copies on one side stream, ordered after the model runner's compute stream."""

    def __init__(self, device: Any, num_layers: int, backend: Any = None) -> None:
        if backend is None:
            import torch

            backend = torch.cuda
        self.backend = backend
        self.device = device
        self.side = backend.Stream(device)
        self.compute: Any = None  # the model runner's stream, once bound
        self.layer_events: list[Any] = [None] * num_layers

    def bind_compute(self) -> None:
        self.compute = self.backend.current_stream(self.device)

    @contextlib.contextmanager
    def copying(self) -> Iterator[None]:
        compute = self.compute or self.backend.current_stream(self.device)
        # after everything the forward has queued (this step's KV writes)
        self.side.wait_stream(compute)
        with self.backend.stream(self.side):
            yield

    def layer_loaded(self, layer: int) -> None:
        event = self.backend.Event()
        event.record(self.side)
        self.layer_events[layer] = event

    def wait_layer(self, layer: int) -> None:
        event = self.layer_events[layer]
        if event is not None:
            (self.compute or self.backend.current_stream(self.device)).wait_event(event)
            self.layer_events[layer] = None

    def synchronize(self) -> None:
        self.side.synchronize()
