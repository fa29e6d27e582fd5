"""Free-list allocator that counts what it hands out, so tests can assert nothing leaks.

Index 0 is reserved (the null block / null slot that padded rows point at).
"""


class OutOfCapacity(RuntimeError):
    pass


class CountingAllocator:
    def __init__(self, capacity: int, name: str):
        if capacity < 2:
            raise ValueError(f"{name}: capacity must be at least 2 (index 0 is reserved), got {capacity}")
        self.name = name
        self.capacity = capacity - 1  # usable entries
        self._free = list(range(capacity - 1, 0, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfCapacity(f"{self.name}: need {n}, only {len(self._free)} free")
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if i not in self._used:
                raise ValueError(f"{self.name}: freeing {i}, which is not allocated")
            self._used.remove(i)
            self._free.append(i)
