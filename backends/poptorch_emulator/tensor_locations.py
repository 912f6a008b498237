"""``poptorch.TensorLocationSettings`` and ``Options.TensorLocations``: where tensors are stored on an IPU.

Same setters, argument checks and recorded keys as PopTorch (python/options.py): a ``TensorLocationSettings``
records ``onChip``, ``useReplicatedTensorSharding``, ``useIOTilesToLoad``, ``useIOTilesToStore`` (as 0/1),
``minElementsForOffChip`` and ``minElementsForReplicatedTensorSharding``; ``Options.TensorLocations`` records
one such dictionary per kind of tensor (``location_activation``, ``location_weight``, ``location_optimizer``,
``location_accumulator``) and ``numIOTiles``. Wrong argument types fail with a bare ``AssertionError``, as in
PopTorch. The emulator keeps these as settings only: a CPU has one memory, so nothing moves.
"""

from __future__ import annotations

from ._options_dict import _OptionsDict

IO_TILES_MESSAGE = "numIOTiles must be an even number between 32 and 192."


class TensorLocationSettings(_OptionsDict):
    """Where one kind of tensor is stored: ``TensorLocationSettings().useOnChipStorage(False)``."""

    def minElementsForOffChip(self, min_elements: int) -> "TensorLocationSettings":
        """Tensors with fewer elements than this stay on chip."""
        assert isinstance(min_elements, int)
        self.createOrSet(minElementsForOffChip=min_elements)
        return self

    def minElementsForReplicatedTensorSharding(self, min_elements: int) -> "TensorLocationSettings":
        """Shard across replicas only tensors with more elements than this."""
        assert isinstance(min_elements, int)
        self.createOrSet(minElementsForReplicatedTensorSharding=min_elements)
        return self

    def useOnChipStorage(self, use: bool | None = True) -> "TensorLocationSettings":
        """True: on-chip memory; False: off-chip (streaming) memory; None: leave it undecided."""
        if use is None:
            self.deleteIfExists("onChip")
        else:
            assert isinstance(use, bool)
            self.createOrSet(onChip=int(use))
        return self

    def useReplicatedTensorSharding(self, use: bool = True) -> "TensorLocationSettings":
        """Shard weights and optimizer states across replicas."""
        assert isinstance(use, bool)
        self.createOrSet(useReplicatedTensorSharding=int(use))
        return self

    def useIOTilesToLoad(self, use: bool = True) -> "TensorLocationSettings":
        """Load the tensor through the IO tiles (True) or the compute tiles (False)."""
        assert isinstance(use, bool)
        self.createOrSet(useIOTilesToLoad=int(use))
        return self

    def useIOTilesToStore(self, use: bool = True) -> "TensorLocationSettings":
        """Store the tensor through the IO tiles (True) or the compute tiles (False)."""
        assert isinstance(use, bool)
        self.createOrSet(useIOTilesToStore=int(use))
        return self


class _TensorLocationOptions(_OptionsDict):
    """``opts.TensorLocations``: a :class:`TensorLocationSettings` per kind of tensor, and the IO tiles."""

    def numIOTiles(self, num_tiles: int) -> "_TensorLocationOptions":
        """Tiles given to IO instead of compute: an even number from 32 to 192."""
        assert isinstance(num_tiles, int)
        if num_tiles < 32 or num_tiles > 192 or num_tiles % 2:
            raise AssertionError(IO_TILES_MESSAGE)
        self.createOrSet(numIOTiles=num_tiles)
        return self

    def _set_location(self, kind: str, location: TensorLocationSettings) -> "_TensorLocationOptions":
        assert isinstance(location, TensorLocationSettings)
        self.createOrSet(**{f"location_{kind}": location.toDict()})
        return self

    def setActivationLocation(self, location: TensorLocationSettings) -> "_TensorLocationOptions":
        return self._set_location("activation", location)

    def setWeightLocation(self, location: TensorLocationSettings) -> "_TensorLocationOptions":
        return self._set_location("weight", location)

    def setOptimizerLocation(self, location: TensorLocationSettings) -> "_TensorLocationOptions":
        return self._set_location("optimizer", location)

    def setAccumulatorLocation(self, location: TensorLocationSettings) -> "_TensorLocationOptions":
        return self._set_location("accumulator", location)


__all__ = ["IO_TILES_MESSAGE", "TensorLocationSettings"]
