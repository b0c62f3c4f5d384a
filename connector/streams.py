"""Where a worker's copies run relative to the model runner's forward.

On the CPU backend copies are memcpys on the calling thread: nothing to order. On CUDA loads
and saves run on side streams, each ordered against the stream the *model runner* computes
on, captured on its thread (``bind_compute``): layer-wise loads are issued from the
``kvtier-load`` thread, whose current stream is the device's default stream, while vLLM may
compute on another one.

- Loads write blocks the scheduler has just handed out, which kernels of earlier steps may
  still be using (a block freed last step, its last reader still queued). So the load stream
  waits, once per step at ``bind_compute``, for everything queued before this step's forward,
  and never again: waiting again before each layer would put layer L+1's copy behind layer
  L's compute, which waits for layer L's copy, and nothing would overlap. Each layer's
  attention waits for its own layer's copy (``layer_loaded`` / ``wait_layer``, an event).
  Pages staged on the device (scattered block ids) are scattered into their blocks on a
  third stream, after the layer's uploads, so the next layer's uploads overlap the scatter;
  that layer's event then follows the scatter.
- Saves read a layer's pages right after its forward wrote them: each save waits for the
  compute stream as it stands then (the layer's KV writes are queued), and for the loads and
  scatters issued so far (a chunk can be part loaded, part computed in one step).

``DeviceOrdering`` takes the CUDA API as ``backend`` (``torch.cuda``) so tests can check the
ordering with a recording stand-in on machines without a GPU; ``tests/gpu`` checks it on one.

Threading: ``bind_compute``, ``wait_layer`` and ``saving`` on the model-runner thread;
``loading``, ``scattering`` and ``layer_loaded`` on whichever thread copies.
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
    def loading(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        yield

    def layer_loaded(self, layer: int, scattered: bool = False) -> None:
        return None

    def wait_layer(self, layer: int) -> None:
        return None

    def finish_loads(self) -> None:
        return None

    def loads_issued(self) -> Any:
        """Nothing to wait for: the copies were done when issued."""
        return None

    def finish_saves(self) -> None:
        return None

    @contextlib.contextmanager
    def scattering(self) -> Iterator[None]:
        yield

    def current(self) -> int:
        return 0


class DeviceOrdering:
    """CUDA: loads and saves on their own side streams, ordered against the model runner's."""

    def __init__(self, device: Any, num_layers: int, backend: Any = None) -> None:
        if backend is None:
            import torch

            backend = torch.cuda
        self.backend = backend
        self.device = device
        self.load_stream = backend.Stream(device)
        self.save_stream = backend.Stream(device)
        self.scatter_stream = backend.Stream(device)
        self.compute: Any = None  # the model runner's stream, once bound
        self.layer_events: list[Any] = [None] * num_layers

    def _compute(self) -> Any:
        return self.compute or self.backend.current_stream(self.device)

    def bind_compute(self) -> None:
        """Start of a step, on the model-runner thread, before the forward is queued."""
        self.compute = self.backend.current_stream(self.device)
        self.load_stream.wait_stream(self.compute)

    @contextlib.contextmanager
    def loading(self) -> Iterator[None]:
        with self.backend.stream(self.load_stream):
            yield

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        self.save_stream.wait_stream(self._compute())
        self.save_stream.wait_stream(self.load_stream)
        self.save_stream.wait_stream(self.scatter_stream)
        with self.backend.stream(self.save_stream):
            yield

    def layer_loaded(self, layer: int, scattered: bool = False) -> None:
        event = self.backend.Event()
        event.record(self.scatter_stream if scattered else self.load_stream)
        self.layer_events[layer] = event

    def wait_layer(self, layer: int) -> None:
        event = self.layer_events[layer]
        if event is not None:
            self._compute().wait_event(event)
            self.layer_events[layer] = None

    def finish_loads(self) -> None:
        """Block the calling thread until every load copy issued so far is done."""
        self.load_stream.synchronize()
        self.scatter_stream.synchronize()

    def loads_issued(self) -> Any:
        """An event the host can wait on (``synchronize``) for every pool read issued so
        far: they all run on the load stream (uploads, direct copies, the copy kernel); the
        scatter stream only moves staged pages on the device."""
        event = self.backend.Event()
        event.record(self.load_stream)
        return event

    @contextlib.contextmanager
    def scattering(self) -> Iterator[None]:
        """A layer's scatter of staged pages into its blocks, on its own stream after the
        layer's uploads: the next layer's uploads (load stream) overlap it. The layer's
        event then follows the scatter (``layer_loaded(layer, scattered=True)``)."""
        uploaded = self.backend.Event()
        uploaded.record(self.load_stream)
        self.scatter_stream.wait_event(uploaded)
        with self.backend.stream(self.scatter_stream):
            yield

    def current(self) -> int:
        """The current stream's handle, for copies issued through the CUDA runtime."""
        return int(self.backend.current_stream(self.device).cuda_stream)

    def finish_saves(self) -> None:
        """Block the calling thread until every save copy issued so far is in the pool."""
        self.save_stream.synchronize()
