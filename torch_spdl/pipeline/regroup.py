"""Where a pipeline changes how many items there are: ``aggregate`` and ``disaggregate``.

Every other stage maps one item to one item, so an item's seq (its place in the source's order)
stays its place to the end. A :class:`Regroup` ends that numbering: the runtime reads the items
before it through a sink of their own, in input order or as completed, and the regrouped values
become a new source, numbered afresh, for the stages after it (see
:class:`~torch_spdl.pipeline.pipeline.Pipeline`). Failures are not grouped: each goes on alone,
in its place, so the consumer still raises it and the other items still form whole groups.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .items import Failure
from .stats import describe_item

Values = Callable[[Iterator[Any]], Iterator[Any]]


@dataclass(frozen=True)
class Regroup:
    """Turn the stream of values into another: ``fn`` gets the values (failures included, in
    their places) in the order the items before it are read, and yields the new values."""

    name: str
    fn: Values
    in_order: bool = True  # read the items before it in input order, else as they complete


def aggregate(num_items: int, drop_last: bool = False) -> Values:
    """Lists of ``num_items`` consecutive values; the last one shorter unless ``drop_last``."""

    def groups(values: Iterator[Any]) -> Iterator[Any]:
        group: list[Any] = []
        for value in values:
            if isinstance(value, Failure):
                yield value
                continue
            group.append(value)
            if len(group) == num_items:
                yield group
                group = []
        if group and not drop_last:
            yield group

    return groups


@dataclass
class GaveThenRaised:
    """What a generator op gave for one item before it raised (``items``), its error, and the
    item as its stage names it: the disaggregate after the op passes the items on, then fails
    the item there, as SPDL passes each item on as it is yielded. Picklable, as a worker
    process's result must be."""

    items: list[Any]
    error: BaseException
    item: str

    def __iter__(self) -> Iterator[Any]:
        yield from self.items
        raise self.error


def disaggregate(name: str) -> Values:
    """Each value's elements, one by one; a value that is not iterable, or whose iteration
    raises (a generator an op returned), fails alone, named, after the elements it gave."""

    def elements(values: Iterator[Any]) -> Iterator[Any]:
        for value in values:
            if isinstance(value, Failure):
                yield value
            else:
                yield from _parts(name, value)

    return elements


def _parts(name: str, value: Any) -> Iterator[Any]:
    """``value``'s elements, then its Failure if reading them raised: raised here, the error
    would end the regrouped stream, and with it the items of every value after this one."""
    try:
        parts = iter(value)
    except BaseException:  # not iterable (a TypeError), or its __iter__ raised
        yield _failed(name, value)
        return
    while True:
        try:
            part = next(parts)
        except StopIteration:
            return
        except BaseException:  # SystemExit too: it fails the value, not the stream
            yield _failed(name, value)
            return
        yield part  # outside the try: a GeneratorExit here is this generator's own closing


def _failed(name: str, value: Any) -> Failure:
    """The exception being handled, as ``value``'s Failure in stage ``name``."""
    item = value.item if isinstance(value, GaveThenRaised) else describe_item(value)
    return Failure.capture(f"in stage {name!r} for {item}", value, name)
