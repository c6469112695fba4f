"""``Slot``: one quantized tensor of one GEMM (its role, quantizer and delayed-scaling state), and
how it is quantized: current or delayed scaling, the amax a producer computed, the quantized
sequence-parallel gather."""

from __future__ import annotations

import collections
import dataclasses
import weakref

import torch

from dtq._torch_private import checkpoint_region
from dtq.codec import COLUMNWISE, ROWWISE, shape_2d
from dtq.distributed import tp
from dtq.formats import Quantizer
from dtq.recipe import QuantizerRole


@dataclasses.dataclass
class Slot:
    """One quantized tensor of one GEMM: its role and quantizer (None: high precision) and, under
    delayed scaling, the name of the module buffer holding its amax history."""

    role: QuantizerRole | None
    quantizer: Quantizer | None
    owner: weakref.ReferenceType | None = None
    history: str | None = None
    margin: int = 0
    most_recent: bool = False
    last_amax: torch.Tensor | None = None
    # Scales used inside torch.utils.checkpoint regions, in call order, for their recompute:
    # {region: deque of amaxes} (weak keys: a region's entries go when its graph does).
    replays: weakref.WeakKeyDictionary = dataclasses.field(
        default_factory=weakref.WeakKeyDictionary, repr=False, compare=False
    )

    @torch.no_grad()
    def _delayed_amax(self, x: torch.Tensor, replay: bool, group=None, sync=None) -> torch.Tensor:
        if replay and (amax := self.replayed_amax()) is not None:
            return amax
        cur = x.detach().abs().amax().float() if x.numel() else torch.zeros((), device=x.device)
        if group is not None:  # a sequence-parallel shard: the history tracks the whole tensor
            torch.distributed.all_reduce(cur, op=torch.distributed.ReduceOp.MAX, group=group)
        return self.delayed_amax(cur, sync)

    @torch.no_grad()
    def delayed_amax(self, cur: torch.Tensor, sync=None) -> torch.Tensor:
        """The delayed-scaling amax for a tensor whose current amax (over the whole tensor) is
        ``cur``: from the history, which then takes ``cur`` as its newest entry."""
        hist = getattr(self.owner(), self.history)  # looked up each time: .to()/.cuda() replace buffers
        # Under autocast(amax_group=...), the newest entries of this region are local until the
        # flush: the scale comes from the shared ones before them (zeros if none are left).
        shared = hist[sync.pending(hist) :] if sync is not None else hist
        if shared.numel() == 0:
            past = torch.zeros((), dtype=hist.dtype, device=hist.device)
        else:
            past = shared[0] if self.most_recent else shared.amax()
        amax = torch.where(past > 0, past, cur.to(hist.device)) * (2.0**self.margin)  # first step: current
        hist.copy_(torch.roll(hist, 1))
        hist[0] = cur
        if sync is not None:  # dtq.autocast(amax_group=...): entry 0 is reduced over the group later
            sync.add(hist)
        self.last_amax = amax
        region = checkpoint_region()
        if region is not None:  # recomputed later: that call must see this scale, not the history's
            self.replays.setdefault(region, collections.deque()).append(amax)
        return amax

    def replayed_amax(self) -> torch.Tensor | None:
        """The amax of the forward call a recompute replays (the history moves once): the next one
        recorded in this checkpoint region, else the last one used."""
        region = checkpoint_region()
        queue = self.replays.get(region) if region is not None else None
        if queue:
            return queue.popleft()
        return self.last_amax

    def _known_amax(self, x: torch.Tensor, known: torch.Tensor, rowwise: bool, columnwise: bool) -> dict:
        """``{direction: known}`` for the requested directions whose scale derives from max|x|
        over the whole tensor (current scaling), where ``known`` is that value already (computed
        by the kernel that produced x)."""
        shape = shape_2d(x.shape)
        return {
            d: known
            for d, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise))
            if on and _scales_from_tensor_amax(self.quantizer.codec(d), shape)
        }

    def takes_tensor_amax(self) -> bool:
        """Whether a direction of this slot scales from max|x| over the whole tensor (current
        scaling), so that an amax computed ahead (by x's producer) spares its quantization a pass.
        A tensor-wide amax has shape ``()`` whatever the tensor's, hence the probe shape."""
        q = self.quantizer
        return (
            q is not None
            and self.history is None
            and any(_scales_from_tensor_amax(q.codec(d), (1, 1)) for d in (ROWWISE, COLUMNWISE))
        )

    def quantize(
        self,
        x: torch.Tensor,
        rowwise: bool,
        columnwise: bool,
        replay: bool = False,
        group=None,
        sync=None,
        known_amax: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x`` quantized into the requested directions; with a ``group``, ``x`` is this rank's
        sequence-parallel shard and the result is the gathered whole (docs/design.md §5: quantized, with
        scales agreed across the group). ``sync``: the :class:`dtq.distributed.amax.AmaxSync` that
        reduces this step's delayed-scaling amax over the ranks sharing histories, or None.
        ``known_amax``: max|x| if the producer of x computed it (used by current scaling only)."""
        if group is not None and self.quantizer is None:
            return tp.gather_rows(x, group, reason=f"the recipe gives no quantizer for {self.role}")
        if self.quantizer is None or not (rowwise or columnwise):
            return x
        amax = self._delayed_amax(x, replay, group, sync) if self.history is not None else None
        if amax is None and group is None and known_amax is not None:
            amax = self._known_amax(x, known_amax, rowwise, columnwise) or None
        try:
            if group is None:
                return self.quantizer.quantize_data(x, rowwise=rowwise, columnwise=columnwise, amax=amax)
            dirs = [d for d, on in ((ROWWISE, rowwise), (COLUMNWISE, columnwise)) if on]
            return tp.gather_along_first_dim(
                x,
                group,
                self.quantizer,
                rowwise=rowwise,
                columnwise=columnwise,
                amax=None if amax is None else {d: amax for d in dirs},
            )
        except ValueError as e:
            raise ValueError(f"{self.role}: {e}") from None


def _scales_from_tensor_amax(codec, shape: tuple[int, int]) -> bool:
    return (
        codec is not None and codec.needs_amax() and codec.amax_space() == "x" and tuple(codec.amax_shape(shape)) == ()
    )
