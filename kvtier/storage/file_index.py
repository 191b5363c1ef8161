"""The local-file L3 backend's index (``kvtier.storage.file``): which keys are stored, their
sizes in LRU order, where packed keys live, and the bytes held against the budget.

Not thread-safe: the backend holds its lock around every call, and eviction unlinks victim
files under that lock, so a concurrent re-store of a victim key cannot lose its fresh file.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvtier.errors import IntegrityError
from kvtier.storage.base import log
from kvtier.storage.file_io import unlink_quiet
from kvtier.storage.file_pack import Packed


class FileIndex:
    """Stored keys and their sizes (envelope header included), least recently used first;
    ``used`` is what they are charged plus the reservations of writes in flight, kept within
    ``budget_bytes`` by evicting from the front. A pack (``kvtier.storage.file_pack``) enters
    and leaves whole: evicting or dropping any of its keys drops them all and deletes it. A
    damaged object of a pack is *discarded* alone: its bytes stay on disk, charged to the pack
    as dead bytes, until the pack leaves (with its last object, at the latest).

    An object this process wrote is charged its size. With ``sharers > 1`` processes sharing
    the directory (a context-parallel group: each writes its own objects, each indexes what its
    start-up scan finds), an object found by the scan is charged ``ceil(size / sharers)``, so
    with every sharer within ``budget_bytes`` the directory holds at most ``sharers x
    budget_bytes``. Why, for a group that starts together: a found object leaves a sharer's
    index only when it is deleted (or cannot be read), so one still on disk is in every
    sharer's index, and the found bytes on disk are at most what the sharers together are
    charged for them; each sharer's own writes are charged whole.
    """

    def __init__(
        self,
        budget_bytes: int,
        path_of: Callable[[str], str],
        where: str,
        sharers: int = 1,
    ) -> None:
        """``path_of(key)``: the file of a key stored on its own; ``where``: the directory,
        for the warning when a full disk lowers the budget; ``sharers``: processes whose
        objects share the directory (see the class)."""
        self.budget_bytes = budget_bytes
        self.sharers = sharers
        self.used = 0
        """Bytes charged for indexed objects plus reservations of writes in flight."""
        self.evictions = 0
        """Keys evicted to make room, in total."""
        self._path_of = path_of
        self._dir = where
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._charged: dict[str, int] = {}
        """What each key is charged where that is not its size (found by a shared scan)."""
        self._where: dict[str, Packed] = {}
        """Where each packed key is; other keys are files of their own."""
        self._packs: dict[str, list[str]] = {}
        """The keys of each pack, all indexed."""
        self._dead: dict[str, tuple[int, int]] = {}
        """Per pack, ``(bytes, charged)`` of its objects no longer indexed (discarded)."""
        self._shrunk = False

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    @property
    def where(self) -> dict[str, Packed]:
        """Packed keys and where they are (read-only use: ``file_layout.reads``)."""
        return self._where

    def file_of(self, key: str) -> str:
        """The file holding ``key``'s object: its pack, or its own file."""
        w = self._where.get(key)
        return w.pack if w is not None else self._path_of(key)

    def add(self, key: str, size: int, where: Packed | None = None) -> None:
        """Index an object found on disk (the restart scan), as most recent; charged its
        share (see the class)."""
        self._sizes[key] = size
        charge = -(-size // self.sharers)
        if charge != size:
            self._charged[key] = charge
        self.used += charge
        if where is not None:
            self._where[key] = where
            self._packs.setdefault(where.pack, []).append(key)

    def add_dead(self, pack: str, size: int) -> None:
        """The restart scan found ``size`` bytes of the indexed ``pack`` that no indexed object
        is charged (``file_layout.Scan.dead``): charged as found bytes are (see the class)."""
        self._charge_dead(pack, size, -(-size // self.sharers))

    def _charge_dead(self, pack: str, size: int, charge: int) -> None:
        held, charged = self._dead.get(pack, (0, 0))
        self._dead[pack] = (held + size, charged + charge)
        self.used += charge

    def hit(self, key: str) -> bool:
        """Make ``key`` most recent; ``False`` when it is not indexed."""
        if key not in self._sizes:
            return False
        self._sizes.move_to_end(key)
        return True

    def leading(self, keys: Sequence[str]) -> int:
        """Length of the leading run of indexed ``keys``, each made most recent."""
        n = 0
        for key in keys:
            if not self.hit(key):
                break
            n += 1
        return n

    def evict(self, incoming: int) -> None:
        """Drop least recent objects (deleting their files) until ``incoming`` more bytes
        fit."""
        while self._sizes and self.used + incoming > self.budget_bytes:
            self.evictions += self.drop(next(iter(self._sizes)), True)

    def reserve(self, size: int, round_holds: bool) -> bool:
        """Evict least recent objects until ``size`` more bytes fit, then reserve them for a
        write. ``False`` (nothing reserved) when they still do not fit and ``round_holds``: the
        caller's own writes in flight hold the room, and once indexed they can be evicted."""
        self.evict(size)
        if round_holds and self.used + size > self.budget_bytes:
            return False
        self.used += size
        return True

    def release(self, size: int) -> None:
        """Give back a reservation of a write that did not happen."""
        self.used -= size

    def exchange(self, held: int, size: int) -> bool:
        """Trade a reservation of ``held`` bytes for one of ``size`` (evicting to fit);
        ``False``, keeping ``held``, when ``size`` does not fit."""
        self.used -= held
        self.evict(size)
        if self.used + size > self.budget_bytes:
            self.used += held
            return False
        self.used += size
        return True

    def write_failed(self, size: int, disk_full: bool) -> bool:
        """A write holding a reservation of ``size`` failed: on a full disk (``disk_full``) the
        budget shrinks to what the disk holds and least recent objects go (:meth:`shrink`);
        ``True`` keeps the reservation for a retry, ``False`` gives it back."""
        self.used -= size
        if disk_full and self.shrink(size):
            self.used += size
            return True
        return False

    def drop(self, key: str, delete: bool) -> int:
        """Take indexed ``key`` out, with every key of its pack if packed (the pack is
        deleted); its own file is deleted with ``delete``. Returns the keys taken out."""
        w = self._where.get(key)
        path = self._path_of(key) if w is None else w.pack
        keys = [key] if w is None else self._packs.pop(w.pack)
        for k in keys:
            size = self._sizes.pop(k)
            self.used -= self._charged.pop(k, size)
            self._where.pop(k, None)
        if w is not None:
            self.used -= self._dead.pop(w.pack, (0, 0))[1]
        if w is not None or delete:
            unlink_quiet(path)
        return len(keys)

    def discard(self, key: str, through_end: bool = False, file_size: int | None = None) -> int:
        """Take the damaged object of indexed ``key`` out: its own file is deleted; a packed
        one leaves its pack alone (its bytes stay charged as the pack's dead bytes; the pack is
        deleted with its last object). With ``through_end`` (the pack ends inside the object)
        the objects after it in the pack go too, and ``file_size``, the pack's size now, makes
        its dead bytes what the file holds beyond the objects left. Returns the keys taken out
        (0: not indexed)."""
        if key not in self._sizes:
            return 0
        w = self._where.get(key)
        if w is None:
            return self.drop(key, True)
        keys = self._packs[w.pack]
        gone = [k for k in keys if k == key or (through_end and self._where[k].number > w.number)]
        if len(gone) == len(keys):
            return self.drop(key, True)
        for k in gone:
            size = self._sizes.pop(k)
            self._where.pop(k)
            keys.remove(k)
            charge = self._charged.pop(k, size)
            self.used -= charge
            self._charge_dead(w.pack, size, charge)
        if file_size is not None:
            # the file was cut behind the index: charge what it holds, not what it held
            held, charged = self._dead.pop(w.pack)
            self.used -= charged
            dead = max(0, file_size - sum(self._sizes[k] for k in keys))
            if dead:
                found = any(k in self._charged for k in keys)
                self._charge_dead(w.pack, dead, -(-dead // self.sharers) if found else dead)
        return len(gone)

    def settle(self, key: str, size: int) -> None:
        """An object written to its own file with ``size`` bytes reserved: index it, or, when
        the key was indexed meanwhile (or twice in one round), give the reservation back."""
        if key in self._sizes:
            self.used -= size
        else:
            self._sizes[key] = size

    def add_pack(
        self, path: str, keys: Sequence[str], sizes: Sequence[int], places: Sequence[Packed]
    ) -> None:
        """Index the pack at ``path``, whose bytes are reserved: its ``keys`` with their object
        ``sizes`` and ``places``, in pack order. A key indexed meanwhile elsewhere is dropped
        first (the pack's copy wins)."""
        for key in keys:
            if key in self._sizes:
                self.drop(key, True)
        for key, size, place in zip(keys, sizes, places, strict=True):
            self._sizes[key] = size
            self._where[key] = place
        self._packs[path] = list(keys)

    def shrink(self, incoming: int) -> bool:
        """The disk is full: make what it holds now the budget and evict least recent
        objects so ``incoming`` more bytes fit; ``False`` when nothing is left to evict."""
        if not self._sizes:
            return False
        budget = max(self.used, incoming)
        if budget < self.budget_bytes:
            if not self._shrunk:
                log.warning(
                    "L3 file backend: %s is full; storage budget lowered from %d to %d bytes",
                    self._dir,
                    self.budget_bytes,
                    budget,
                )
            self._shrunk = True
            self.budget_bytes = budget
        self.evict(incoming)
        return True

    def keys(self) -> list[str]:
        """Indexed keys, least recently used first."""
        return list(self._sizes)

    def snapshot(
        self,
    ) -> tuple[dict[str, int], dict[str, Packed], dict[str, list[str]], dict[str, int]]:
        """Copies of the sizes, the packed keys' places, each pack's keys and each pack's dead
        bytes (where it has any)."""
        return (
            dict(self._sizes),
            dict(self._where),
            {p: list(k) for p, k in self._packs.items()},
            {p: held for p, (held, _) in self._dead.items()},
        )

    def check_integrity(self) -> None:
        """``used`` is what the indexed objects are charged (call it with no write in flight)
        and within the budget. Raises ``IntegrityError``. (Disk against index:
        ``file_layout.disagreements`` of a ``snapshot``.)"""
        if not self._charged.keys() <= self._sizes.keys():
            raise IntegrityError("file backend: a charge is kept for a key not indexed")
        if not self._dead.keys() <= self._packs.keys():
            raise IntegrityError("file backend: dead bytes are kept for a pack not indexed")
        held = sum(self._charged.get(k, z) for k, z in self._sizes.items())
        held += sum(charged for _, charged in self._dead.values())
        if self.used != held or self.used > self.budget_bytes:
            raise IntegrityError(
                f"file backend: {self.used} bytes in use, {held} indexed, "
                f"budget {self.budget_bytes}"
            )
