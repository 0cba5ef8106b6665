"""Weight offload for the offloading systems' schedules: every decoder layer's weights live in a host copy and
are copied into the layer's device tensors before the layer runs, once per forward (FlexGen's zig-zag block:
one copy per layer, reused by every micro-batch of the block; ZeRO-Inference's layer streaming).

The host copy is the source of truth (pinned on CUDA, so the copies are asynchronous DMA on a side stream; the
compute stream waits for a layer's copy before using it, and the next layer's copy is issued as soon as this
layer's starts: prefetch). On a CPU device host == device, but the copy still happens, so the bytes a policy is
charged for are moved. The device tensors stay allocated for every layer (a ring of two layers' buffers would
save device memory; the executor runs small models and keeps the module structure as it is): what is checked
here is that the computation reads weights that went through the copy, and how many bytes it moved.
"""

from __future__ import annotations

import torch

from batchgen.exec.models.decoder import MoEDecoder


class WeightStreamer:
    """Per-layer host copies of a model's decoder-layer parameters and the copies into the device tensors."""

    def __init__(self, model: MoEDecoder):
        self.model = model
        device = next(model.parameters()).device
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.layers: list[list[tuple[torch.Tensor, torch.Tensor]]] = []
        with torch.no_grad():
            for block in model.layers:
                pairs = []
                for p in block.parameters():
                    host = p.detach().to("cpu", copy=True)
                    pairs.append((p, host.pin_memory() if self.cuda else host))
                self.layers.append(pairs)
        self._layer_bytes = [sum(h.numel() * h.element_size() for _, h in pairs) for pairs in self.layers]
        self.copied_bytes = 0
        self._ready: dict[int, object] = {}

    def layer_bytes(self, layer: int) -> int:
        return self._layer_bytes[layer]

    @torch.no_grad()
    def issue(self, layer: int) -> None:
        """Start copying `layer`'s weights from the host copy into its device tensors."""
        if layer >= len(self.layers) or layer in self._ready:
            return
        if self.cuda:
            with torch.cuda.stream(self.stream):
                for p, h in self.layers[layer]:
                    p.data.copy_(h, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
            self._ready[layer] = event
        else:
            for p, h in self.layers[layer]:
                p.data.copy_(h)
            self._ready[layer] = True
        self.copied_bytes += self.layer_bytes(layer)

    def acquire(self, layer: int) -> None:
        """`layer`'s weights are on the device (wait for its copy); prefetch the next layer's."""
        self.issue(layer)
        ready = self._ready.pop(layer)
        if self.cuda:
            torch.cuda.current_stream().wait_event(ready)
        self.issue(layer + 1)

    def finish(self) -> None:
        """End of a forward: drop a prefetch issued past the last layer's use (none is: issue stops there)."""
        self._ready.clear()

    @torch.no_grad()
    def scramble(self) -> None:
        """Overwrite the device tensors (a test's proof that a forward reads only what the copies brought)."""
        for pairs in self.layers:
            for p, _ in pairs:
                p.data.zero_()
