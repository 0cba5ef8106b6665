"""Weights that live on the host and pass through two device staging buffers, layer by layer.

`batchgen.memory.plan_memory` decides which weights a rank cannot keep on its device: the routed experts of
some MoE layers, or (when even the non-expert weights do not fit) every decoder layer whole. The simulator
then credits the device memory those weights would take and charges a host -> device copy of them per
forward. This module makes the executor do exactly that:

- each streamed layer's streamed parameters are packed into one contiguous host buffer (pinned when the device
  is CUDA, so that the copy is an asynchronous DMA), and their device tensors are freed;
- the device holds `min(2, streamed layers)` staging slots, each as large as the largest streamed layer (the
  memory plan's "ring of two layers"); the k-th streamed layer in forward order owns slot k % 2, and its
  parameters are views into that slot, permanently: nothing is swapped at run time, the slot's bytes are valid
  for the layer between `acquire(layer)` and the next copy into that slot;
- `acquire(layer)` makes the layer's weights ready (copies them if its prefetch was not issued) and issues the
  next streamed layer's copy into the other slot. On CUDA the copy runs on a side stream: it first waits for an
  event recorded on the compute stream (everything enqueued before this layer: the slot's previous occupant,
  two streamed layers back, is done with it), and the compute stream waits on the copy's own event before the
  layer runs. On the CPU the copies are synchronous, from a separate host buffer into the separate slots.

Every streamed layer is copied once per forward (FlexGen's block: one copy per layer, reused by every
micro-batch; ZeRO-Inference's layer streaming), even where both slots would already hold the right layer,
because the simulator charges every streamed byte on every forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from batchgen.exec.models.decoder import MoEDecoder

ALIGN = 512  # bytes: every parameter view starts on this boundary, as CUDA's allocator aligns its blocks (so
#              kernels see the alignment they see for a resident parameter; vectorised loads need 16)
EXPERT_PARAMS = ("w_gate", "w_up", "w_down")  # a SparseMoE's routed experts, [E, ...] each


@dataclass(frozen=True)
class StreamSpec:
    """What streams: every decoder layer whole (`whole`), or the routed experts of `moe_layers` MoE layers out
    of `of_moe_layers` in the memory plan's model (the executor's model may have another count: the same share
    of its MoE layers, at least one, the last ones, streams)."""

    whole: bool
    moe_layers: int
    of_moe_layers: int

    def __post_init__(self):
        if not 0 <= self.moe_layers <= self.of_moe_layers:
            raise ValueError(f"StreamSpec: moe_layers must be within 0..{self.of_moe_layers}, got {self.moe_layers}")


def stream_spec_of(budget, model_spec) -> StreamSpec | None:
    """The memory plan's choice (`MemoryBudget.streamed_layers`, `.whole_layers`), None when nothing streams."""
    if not budget.streamed_layers:
        return None
    return StreamSpec(bool(budget.whole_layers), int(budget.streamed_layers), int(model_spec.num_moe_layers))


def streamed_parameters(model: MoEDecoder, spec: StreamSpec) -> list[tuple[int, list[torch.nn.Parameter]]]:
    """(layer, its streamed parameters) for every streamed layer, in forward order."""
    out = []
    moe_layers = [i for i in range(model.num_layers) if model.moe(i) is not None]
    if spec.whole:
        for i, block in enumerate(model.layers):
            out.append((i, list(block.parameters())))
        return out
    k = len(moe_layers) if spec.moe_layers == spec.of_moe_layers else max(1, round(
        spec.moe_layers * len(moe_layers) / max(spec.of_moe_layers, 1)))
    for i in moe_layers[len(moe_layers) - k:]:
        mlp = model.moe(i)
        out.append((i, [getattr(mlp, name) for name in EXPERT_PARAMS]))
    return out


def _layout(params: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of `params` packed in order with ALIGN-aligned starts, and the packed size."""
    offsets, end = [], 0
    for p in params:
        end = -(-end // ALIGN) * ALIGN
        offsets.append(end)
        end += p.numel() * p.element_size()
    return offsets, end


@dataclass(frozen=True)
class Footprint:
    """Bytes of the streamed weights: their host copies, the device slots, and what the slots replace."""

    host_bytes: int          # packed host copies of every streamed layer
    staging_bytes: int       # the device slots: min(2, layers) x the largest streamed layer
    streamed_bytes: int      # the streamed parameters' own bytes (no longer on the device)
    layers: int


def footprint(model: MoEDecoder, spec: StreamSpec | None) -> Footprint:
    """Works on a model on the meta device too (`meta_model`): what `check_fits` counts before any weight is
    built is what `WeightStreamer` allocates."""
    if spec is None:
        return Footprint(0, 0, 0, 0)
    sizes, own = [], 0
    for _, params in streamed_parameters(model, spec):
        sizes.append(_layout(params)[1])
        own += sum(p.numel() * p.element_size() for p in params)
    slots = min(2, len(sizes))
    return Footprint(sum(sizes), slots * max(sizes, default=0), own, len(sizes))


def meta_model(config, dtype: torch.dtype) -> MoEDecoder:
    """The model's structure without memory (shapes and dtypes only)."""
    return MoEDecoder(config, device="meta", dtype=dtype)


class WeightStreamer:
    """Moves a model's streamed weights to the host and serves them through the device staging slots."""

    def __init__(self, model: MoEDecoder, spec: StreamSpec, device: torch.device | str):
        """`model` may be anywhere (built on the CPU, so that the streamed weights never occupy the device);
        afterwards its streamed parameters are views into the slots on `device`. The rest of the model is moved
        to `device` by the caller (`stream_onto`)."""
        self.model, self.spec = model, spec
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        plan = streamed_parameters(model, spec)
        if not plan:
            raise ValueError("WeightStreamer: the stream spec selects no layer of this model")
        self.order = [layer for layer, _ in plan]
        self._index = {layer: k for k, layer in enumerate(self.order)}
        layouts = [_layout(params) for _, params in plan]
        width = max(size for _, size in layouts)
        with torch.no_grad():
            self.slots = [torch.empty(width, dtype=torch.uint8, device=self.device)
                          for _ in range(min(2, len(plan)))]
            self.host: list[torch.Tensor] = []
            self.layer_nbytes: list[int] = []
            for k, ((layer, params), (offsets, size)) in enumerate(zip(plan, layouts)):
                flat = torch.zeros(size, dtype=torch.uint8, pin_memory=self.cuda)
                slot = self.slots[k % len(self.slots)]
                for p, off in zip(params, offsets):
                    n = p.numel() * p.element_size()
                    flat[off:off + n].view(p.dtype).view(p.shape).copy_(p.detach())
                    p.data = slot[off:off + n].view(p.dtype).view(p.shape)  # frees the parameter's own tensor
                self.host.append(flat)
                self.layer_nbytes.append(size)
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.copied_bytes = 0
        self._ready: dict[int, object] = {}  # streamed index -> CUDA event (or True on the CPU)

    @property
    def staging_bytes(self) -> int:
        return sum(s.numel() for s in self.slots)

    def streams(self, layer: int) -> bool:
        return layer in self._index

    @torch.no_grad()
    def _issue(self, k: int) -> None:
        """Start copying the k-th streamed layer into its slot (once per forward)."""
        if k >= len(self.order) or k in self._ready:
            return
        slot, flat = self.slots[k % len(self.slots)], self.host[k]
        if self.cuda:
            free = torch.cuda.Event()
            free.record(torch.cuda.current_stream(self.device))  # the slot's previous occupant is done after this
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(free)
                slot[:flat.numel()].copy_(flat, non_blocking=True)
                ready = torch.cuda.Event()
                ready.record(self.stream)
            self._ready[k] = ready
        else:
            slot[:flat.numel()].copy_(flat)
            self._ready[k] = True
        self.copied_bytes += self.layer_nbytes[k]

    def acquire(self, layer: int) -> None:
        """Before `layer` runs: its streamed weights are in its slot (the compute stream waits for their copy),
        and the next streamed layer's copy is issued into the other slot (prefetch)."""
        k = self._index.get(layer)
        if k is not None:
            self._issue(k)
            ready = self._ready.pop(k)
            if self.cuda:
                torch.cuda.current_stream(self.device).wait_event(ready)
            nxt = k + 1
        else:
            nxt = next((j for j, l in enumerate(self.order) if l > layer), len(self.order))
        if len(self.slots) > 1:
            self._issue(nxt)

    def begin(self) -> None:
        """Start of a forward: forget copies of a forward that did not finish (their slots may be overwritten)."""
        self._ready.clear()

    def finish(self) -> None:
        """End of a forward: no copy is left in flight (prefetch stops at the last streamed layer)."""
        left, self._ready = sorted(self.order[k] for k in self._ready), {}
        if left:
            raise RuntimeError(f"weight streamer: layers {left} were copied but never acquired in this forward")


def stream_onto(model: MoEDecoder, spec: StreamSpec | None, device: torch.device | str) -> WeightStreamer | None:
    """Put `model` on `device` with the streamed weights on the host (`spec`; None: everything resident).
    Build the model on the CPU first: its streamed weights then never occupy the device."""
    streamer = WeightStreamer(model, spec, device) if spec is not None else None
    model.to(device)
    return streamer
