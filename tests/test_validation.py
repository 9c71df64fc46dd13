"""Argument validation, attributes and warnings of ``torch_spdl.DataLoader`` against torch's.

Every invalid combination is given to both loaders with the same argument objects; the exception
type and its ``str()`` must be the same. The extras (``io_workers``, ``load_fn``,
``preprocess_fn``) are ours alone and are checked against their documented behaviour.
"""

from __future__ import annotations

import gc
import re
import threading
import typing
import warnings

import pytest
import torch
import torch.utils.data as tud

import torch_spdl
from torch_spdl.compat import TORCH_VERSION

pytestmark = pytest.mark.usefixtures("no_leak")


# -- datasets ------------------------------------------------------------------------------------
class MapDataset(tud.Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        return torch.tensor(i)


class Iterable(tud.IterableDataset):
    def __iter__(self):
        return iter(torch.arange(10))


class WorkerCount(MapDataset):
    """Each sample with the worker count its worker was told."""

    def __getitem__(self, i):
        return torch.tensor([i, tud.get_worker_info().num_workers])


class NoIndexLoad(MapDataset):
    """A dataset with an unrelated ``load()`` (e.g. 'load the index file')."""

    def load(self):
        return None


class HooksOnly(tud.Dataset):
    """Hooks by duck typing: ``load`` and ``preprocess``, and no ``__getitem__`` of its own."""

    def __len__(self):
        return 10


class NoIndexLoadWithPreprocess(HooksOnly):
    def load(self):
        return None

    def preprocess(self, raw):
        return raw


class NoArgPreprocess(HooksOnly):
    def load(self, i):
        return i

    def preprocess(self):
        return None


class IterableWithLoad(Iterable):
    def load(self):
        return None


# -- construction errors -------------------------------------------------------------------------
def raised(cls, args, kwargs):
    try:
        cls(*args, **kwargs)
    except Exception as error:  # any type: the type is what is compared
        return error
    pytest.fail(f"{cls.__module__}.{cls.__qualname__} accepted {args} {kwargs}")


def assert_same_error(dataset, **kwargs):
    want = raised(tud.DataLoader, (dataset,), kwargs)
    got = raised(torch_spdl.DataLoader, (dataset,), kwargs)
    assert type(got) is type(want)
    assert str(got) == str(want)
    assert str(want)  # an empty message would make the comparison vacuous
    return got


LOADERS = (tud.DataLoader, torch_spdl.DataLoader)
MAP = MapDataset()
ITERABLE = Iterable()
SAMPLER = tud.SequentialSampler(range(10))
BATCH_SAMPLER = tud.BatchSampler(SAMPLER, batch_size=3, drop_last=False)
NOT_A_CONTEXT = object()

CONSTRUCTION_ERRORS = {
    "num_workers<0": (MAP, {"num_workers": -1}),
    "num_workers<0 and timeout<0": (MAP, {"num_workers": -2, "timeout": -1}),
    "timeout<0": (MAP, {"timeout": -1}),
    "timeout<0 with workers": (MAP, {"timeout": -0.5, "num_workers": 2}),
    "prefetch_factor without workers": (MAP, {"prefetch_factor": 2}),
    "prefetch_factor=0 without workers": (MAP, {"prefetch_factor": 0}),
    "prefetch_factor<0": (MAP, {"prefetch_factor": -1, "num_workers": 2}),
    "persistent_workers without workers": (MAP, {"persistent_workers": True}),
    "sampler+shuffle": (MAP, {"sampler": SAMPLER, "shuffle": True}),
    "batch_sampler+batch_size": (MAP, {"batch_sampler": BATCH_SAMPLER, "batch_size": 2}),
    "batch_sampler+batch_size=None": (MAP, {"batch_sampler": BATCH_SAMPLER, "batch_size": None}),
    "batch_sampler+shuffle": (MAP, {"batch_sampler": BATCH_SAMPLER, "shuffle": True}),
    "batch_sampler+sampler": (MAP, {"batch_sampler": BATCH_SAMPLER, "sampler": SAMPLER}),
    "batch_sampler+drop_last": (MAP, {"batch_sampler": BATCH_SAMPLER, "drop_last": True}),
    "batch_size=None+drop_last": (MAP, {"batch_size": None, "drop_last": True}),
    "batch_size=0": (MAP, {"batch_size": 0}),
    "batch_size<0": (MAP, {"batch_size": -3}),
    "drop_last not bool": (MAP, {"batch_size": 2, "drop_last": "yes"}),
    "iterable+shuffle": (ITERABLE, {"shuffle": True}),
    "iterable+sampler": (ITERABLE, {"sampler": SAMPLER}),
    "iterable+batch_sampler": (ITERABLE, {"batch_sampler": BATCH_SAMPLER}),
    "iterable+shuffle+sampler": (ITERABLE, {"shuffle": True, "sampler": SAMPLER}),
    "multiprocessing_context without workers": (MAP, {"multiprocessing_context": "spawn"}),
    "bad start method": (MAP, {"multiprocessing_context": "bogus", "num_workers": 2}),
    "not a context": (MAP, {"multiprocessing_context": NOT_A_CONTEXT, "num_workers": 2}),
    "number as context": (MAP, {"multiprocessing_context": 3, "num_workers": 1}),
}


@pytest.mark.parametrize("case", list(CONSTRUCTION_ERRORS))
def test_construction_error_same_as_torch(case):
    dataset, kwargs = CONSTRUCTION_ERRORS[case]
    assert_same_error(dataset, **kwargs)


def test_error_types():
    """The comparisons above are not vacuous: torch raises these types for these cases."""
    expected = {"not a context": TypeError, "number as context": TypeError}
    for case, (dataset, kwargs) in CONSTRUCTION_ERRORS.items():
        error = assert_same_error(dataset, **kwargs)
        assert type(error) is expected.get(case, ValueError), case


def test_non_context_object_is_a_type_error_naming_it():
    error = assert_same_error(MAP, multiprocessing_context=NOT_A_CONTEXT, num_workers=2)
    assert isinstance(error, TypeError)
    assert repr(NOT_A_CONTEXT) in str(error)


def test_too_many_positional_arguments_same_as_torch():
    """The extras are keyword-only: a 14th positional argument is refused like torch does."""
    args = (MAP, 1, None, None, None, 0, None, False, False, 0, None, None, None, 2)
    want = raised(tud.DataLoader, args, {})
    got = raised(torch_spdl.DataLoader, args, {})
    assert type(got) is type(want) is TypeError
    assert str(got) == str(want)


# -- errors raised by iter() ---------------------------------------------------------------------
ITERATOR_ERRORS = {
    "timeout>0 without workers": ({"timeout": 1.0}, AssertionError),
    "prefetch_factor=0 with workers": ({"prefetch_factor": 0, "num_workers": 2}, AssertionError),
    "prefetch_factor a float": ({"prefetch_factor": 1.5, "num_workers": 1}, TypeError),
    "num_workers a float": ({"num_workers": 2.0}, TypeError),
}


def iter_error(loader, error_type):
    with pytest.raises(error_type) as info:
        iter(loader)
    message = str(info.value)
    del info
    gc.collect()  # torch's failed iterator ends here, under the calling test's filters
    return message


def torchs_failed_iterator(test):
    """torch's ``_MultiProcessingDataLoaderIter.__del__`` fails on an iterator whose ``__init__``
    raised, and its result queue's feeder thread may fail as it closes: not ours to report."""
    for warning in ("PytestUnraisableExceptionWarning", "PytestUnhandledThreadExceptionWarning"):
        test = pytest.mark.filterwarnings(f"ignore::pytest.{warning}")(test)
    return test


@pytest.mark.parametrize("case", list(ITERATOR_ERRORS))
@pytest.mark.parametrize("dataset", [MAP, ITERABLE], ids=["map", "iterable"])
@torchs_failed_iterator
def test_iterator_error_same_as_torch(case, dataset):
    kwargs, error_type = ITERATOR_ERRORS[case]
    # construction is accepted; iter() raises
    errors = [iter_error(cls(dataset, **kwargs), error_type) for cls in LOADERS]
    assert errors[0] == errors[1]
    if error_type is AssertionError:
        assert bool(errors[0]) == (TORCH_VERSION >= (2, 10))  # a bare assert's, before torch 2.10
    else:
        assert errors[0]


@torchs_failed_iterator
def test_workers_set_after_init_without_a_prefetch_factor_fail_as_torchs():
    """torch sets ``prefetch_factor`` to 2 only where ``__init__`` had workers."""
    errors = []
    for cls in LOADERS:
        loader = cls(MAP, batch_size=2)
        loader.num_workers = 2
        errors.append(iter_error(loader, TypeError))
    assert errors[0] == errors[1]
    assert "NoneType" in errors[0]


@torchs_failed_iterator
def test_negative_workers_set_after_init_fail_as_torchs():
    errors = []
    for cls in LOADERS:
        loader = cls(MAP, batch_size=2, num_workers=2)
        loader.num_workers = -1
        errors.append(iter_error(loader, AssertionError))
    assert errors[0] == errors[1]


@pytest.mark.parametrize("worker_method", ["thread", "process"])
def test_num_workers_true_is_one_worker_as_in_torch(worker_method):
    batches = [
        [batch.tolist() for batch in loader]
        for loader in (
            tud.DataLoader(WorkerCount(), batch_size=3, num_workers=True),
            torch_spdl.DataLoader(
                WorkerCount(), batch_size=3, num_workers=True, worker_method=worker_method
            ),
        )
    ]
    assert batches[0] == batches[1]
    assert batches[0][0] == [[0, 1], [1, 1], [2, 1]]


def test_iterator_keeps_torchs_worker_attributes():
    """Code written against torch's iterator reads its ``_prefetch_factor`` and ``_in_order``."""
    for cls in LOADERS:
        iterator = iter(cls(MAP, batch_size=2, num_workers=1, prefetch_factor=3, in_order=False))
        assert (iterator._prefetch_factor, iterator._in_order) == (3, False)
        del iterator


# -- the attribute guard -------------------------------------------------------------------------
GUARDED = ["batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers"]


class MyTorchLoader(tud.DataLoader):
    pass


class MyLoader(torch_spdl.DataLoader):
    pass


MyTorchLoader.__name__ = MyTorchLoader.__qualname__ = "MyLoader"


def set_error(loader, attr, value):
    with pytest.raises(ValueError) as info:
        setattr(loader, attr, value)
    return str(info.value)


@pytest.mark.parametrize("attr", GUARDED)
def test_attribute_guard_same_as_torch(attr):
    value = getattr(tud.DataLoader(MAP), attr)
    ours, ref = torch_spdl.DataLoader(MAP, num_workers=2), tud.DataLoader(MAP, num_workers=2)
    before = getattr(ours, attr)
    got, want = set_error(ours, attr, value), set_error(ref, attr, value)
    assert "DataLoader" in want and attr in want
    assert got.replace(type(ours).__name__, "<cls>") == want.replace(type(ref).__name__, "<cls>")
    assert getattr(ours, attr) is before  # the refused assignment changed nothing


@pytest.mark.parametrize("attr", GUARDED)
def test_attribute_guard_names_the_subclass(attr):
    got = set_error(MyLoader(MAP), attr, None)
    want = set_error(MyTorchLoader(MAP), attr, None)
    assert got == want
    assert got == f"{attr} attribute should not be set after MyLoader is initialized"


def device_loader(base: type) -> type:
    """A subclass as users write one for torch's loader: its own ``device`` attribute, set
    before ``super().__init__()``, read by its own ``__iter__``."""

    class DeviceLoader(base):
        def __init__(self, dataset, device, **kwargs):
            self.device = torch.device(device)
            super().__init__(dataset, **kwargs)

        def __iter__(self):
            for batch in super().__iter__():
                yield batch.to(self.device), self.device

    return DeviceLoader


def test_an_attribute_a_subclass_sets_before_init_stays_its_own():
    """torch_spdl's option of that name takes the keyword's value (none here: no transfer of
    its own), the attribute stays the subclass's, assigning it later is the subclass's
    business too, and the subclass is told of the clash once."""
    want = list(device_loader(tud.DataLoader)(MAP, "meta", batch_size=4))
    with pytest.warns(UserWarning, match="DeviceLoader sets device before DataLoader.__init__"):
        ours = device_loader(torch_spdl.DataLoader)(MAP, "meta", batch_size=4)
    assert ours.device == torch.device("meta") and ours._options.device is None
    got = list(ours)
    assert [(b.shape, b.device, d) for b, d in got] == [(b.shape, b.device, d) for b, d in want]
    ours.device = "not a device torch knows"  # the subclass's attribute: not validated
    assert ours._options.device is None


def test_worker_init_fn_can_be_set_after_init():
    calls = []
    lock = threading.Lock()

    def init(worker_id):
        with lock:
            calls.append(worker_id)

    ref = tud.DataLoader(MAP, num_workers=2)
    ref.worker_init_fn = init  # torch allows it
    ours = torch_spdl.DataLoader(MAP, batch_size=2, num_workers=2)
    ours.worker_init_fn = init
    assert ours.worker_init_fn is init
    assert [b.tolist() for b in ours] == [[i, i + 1] for i in range(0, 10, 2)]
    assert sorted(calls) == [0, 1], "the worker_init_fn set after init was not used"


# -- public attributes ---------------------------------------------------------------------------
def worker_init(worker_id):
    pass


def collate(batch):
    return batch


ATTRIBUTES = [
    "dataset",
    "batch_size",
    "drop_last",
    "num_workers",
    "prefetch_factor",
    "pin_memory",
    "pin_memory_device",
    "timeout",
    "worker_init_fn",
    "generator",
    "persistent_workers",
    "in_order",
    "multiprocessing_context",
    "collate_fn",
]

GENERATOR = torch.Generator().manual_seed(3)
ATTRIBUTE_CASES = {
    "defaults": (MAP, {}),
    "batch_size=None": (MAP, {"batch_size": None}),
    "everything": (
        MAP,
        {
            "batch_size": 4,
            "shuffle": True,
            "num_workers": 2,
            "collate_fn": collate,
            "pin_memory": True,
            "drop_last": True,
            "timeout": 5.0,
            "worker_init_fn": worker_init,
            "multiprocessing_context": "spawn",
            "generator": GENERATOR,
            "prefetch_factor": 3,
            "persistent_workers": True,
            "pin_memory_device": "cpu",
            "in_order": False,
        },
    ),
    "sampler": (MAP, {"sampler": SAMPLER, "batch_size": 3}),
    "batch_sampler": (MAP, {"batch_sampler": BATCH_SAMPLER}),
    "context object": (
        MAP,
        {"num_workers": 1, "multiprocessing_context": torch.multiprocessing.get_context("fork")},
    ),
    "iterable": (ITERABLE, {"batch_size": 5, "num_workers": 1}),
    "iterable batch_size=None": (ITERABLE, {"batch_size": None}),
}


@pytest.mark.parametrize("case", list(ATTRIBUTE_CASES))
def test_public_attributes_same_as_torch(case):
    dataset, kwargs = ATTRIBUTE_CASES[case]
    ours, ref = torch_spdl.DataLoader(dataset, **kwargs), tud.DataLoader(dataset, **kwargs)
    for attr in ATTRIBUTES:
        assert getattr(ours, attr) == getattr(ref, attr), attr
    assert ours.dataset is dataset
    # the sampler torch builds is shown as a subclass of its class, which warns when another
    # loader iterates it (test_worker_streams.py); a sampler given is shown as it is
    assert isinstance(ours.sampler, type(ref.sampler))
    if "sampler" in kwargs or "batch_sampler" in kwargs or dataset is not MAP:
        assert type(ours.sampler) is type(ref.sampler)
    assert type(ours.batch_sampler) is type(ref.batch_sampler)
    if "sampler" in kwargs:
        assert ours.sampler is kwargs["sampler"]
    if "batch_sampler" in kwargs:
        assert ours.batch_sampler is kwargs["batch_sampler"]
    if isinstance(ref.batch_sampler, tud.BatchSampler) and "batch_sampler" not in kwargs:
        assert ours.batch_sampler.batch_size == ref.batch_sampler.batch_size
        assert ours.batch_sampler.drop_last == ref.batch_sampler.drop_last
    if isinstance(ref.sampler, tud.RandomSampler):
        assert ours.sampler.generator is ref.sampler.generator is GENERATOR
    if dataset is MAP:
        assert len(ours) == len(ref)


def test_is_a_torch_dataloader_and_generic():
    loader = torch_spdl.DataLoader(MAP)
    assert isinstance(loader, tud.DataLoader)
    assert issubclass(torch_spdl.DataLoader, tud.DataLoader)
    alias = torch_spdl.DataLoader[int]
    assert typing.get_origin(alias) is torch_spdl.DataLoader
    assert typing.get_args(alias) == (int,)
    typed = alias(MAP, batch_size=5)
    assert type(typed) is torch_spdl.DataLoader
    assert [b.tolist() for b in typed] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]


# -- the extras ----------------------------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1, "4", True, False, 2.0, None])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_io_workers_must_be_a_positive_int(value, num_workers):
    with pytest.raises(ValueError, match="io_workers") as info:
        torch_spdl.DataLoader(MAP, num_workers=num_workers, io_workers=value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("name", ["distributed", "preload"])
@pytest.mark.parametrize("value", ["no", "false", 0, 1, None])
def test_boolean_extras_refuse_other_values_as_torch_refuses_drop_last(name, value):
    """A config file's ``"false"`` would be truthy: refused, as torch's ``drop_last`` is."""
    want = f"{name} option should be a boolean value, but got {name}={value!r}"
    with pytest.raises(ValueError, match=re.escape(want)):
        torch_spdl.DataLoader(MAP, **{name: value})
    loader = torch_spdl.DataLoader(MAP)
    with pytest.raises(ValueError, match=re.escape(want)):
        setattr(loader, name, value)


@pytest.mark.parametrize("value", [1, 3, 64])
def test_io_workers_accepts_positive_ints(value):
    loader = torch_spdl.DataLoader(MAP, io_workers=value)
    assert loader.io_workers == value


BAD_HOOKS = {
    "load_fn not callable": ({"load_fn": 42}, "load_fn"),
    "load_fn two arguments": ({"load_fn": lambda a, b: a}, "load_fn"),
    "load_fn no argument": ({"load_fn": lambda: 1}, "load_fn"),
    "load_fn keyword-only": ({"load_fn": lambda *, index: index}, "load_fn"),
    "preprocess_fn no argument": ({"preprocess_fn": lambda: 1}, "preprocess_fn"),
    "preprocess_fn not callable": ({"preprocess_fn": "decode"}, "preprocess_fn"),
    "preprocess_fn two arguments": ({"preprocess_fn": lambda raw, extra: raw}, "preprocess_fn"),
    "bad preprocess_fn with good load_fn": (
        {"load_fn": lambda i: i, "preprocess_fn": lambda: 1},
        "preprocess_fn",
    ),
}


@pytest.mark.parametrize("case", list(BAD_HOOKS))
@pytest.mark.parametrize("num_workers", [0, 2])
def test_bad_hook_is_a_type_error_naming_it(case, num_workers):
    kwargs, name = BAD_HOOKS[case]
    with pytest.raises(TypeError) as info:
        torch_spdl.DataLoader(MAP, num_workers=num_workers, **kwargs)
    assert str(info.value).startswith(name)


@pytest.mark.parametrize(
    "hook",
    [lambda i, scale=2: i * scale, lambda *args: args[0] * 2, abs],
    ids=["default-arg", "varargs", "builtin"],
)
@pytest.mark.parametrize("num_workers", [0, 2])
def test_hooks_with_compatible_signatures_are_accepted(hook, num_workers):
    def double(i):
        return i * 2

    for kwargs in ({"load_fn": hook}, {"preprocess_fn": hook}):
        loader = torch_spdl.DataLoader(MAP, batch_size=5, num_workers=num_workers, **kwargs)
        batches = [b.tolist() for b in loader]
        if hook is abs:
            assert batches == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
        else:
            assert batches == [[double(i) for i in range(5)], [double(i) for i in range(5, 10)]]


@pytest.mark.parametrize(
    ("dataset", "name"),
    [
        (NoIndexLoadWithPreprocess(), "NoIndexLoadWithPreprocess.load"),
        (NoArgPreprocess(), "NoArgPreprocess.preprocess"),
    ],
)
def test_dataset_hook_without_its_argument_is_a_type_error(dataset, name):
    with pytest.raises(TypeError) as info:
        torch_spdl.DataLoader(dataset)
    assert str(info.value).startswith(name)
    tud.DataLoader(dataset)  # torch does not look at these methods


class Labelled(MapDataset):
    """``load`` and ``preprocess`` as helpers of its own ``__getitem__``, which adds the label:
    what torch's loader reads, and so does this one."""

    paths = [f"img{i}.jpg" for i in range(10)]

    def load(self, path):
        return len(path)

    def preprocess(self, raw):
        return raw * 2

    def __getitem__(self, i):
        return self.preprocess(self.load(self.paths[i])), i


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_datasets_own_getitem_is_read_beside_helpers_named_like_hooks(num_workers):
    want = [[b.tolist() for b in batch] for batch in tud.DataLoader(Labelled(), batch_size=4)]
    loader = torch_spdl.DataLoader(Labelled(), batch_size=4, num_workers=num_workers)
    assert [[b.tolist() for b in batch] for batch in loader] == want


def test_staged_dataset_without_preprocess_uses_the_identity():
    class LoadOnly(torch_spdl.StagedDataset):
        preprocess = None

        def __len__(self):
            return 6

        def load(self, index):
            return index * 2

    got = [b.tolist() for b in torch_spdl.DataLoader(LoadOnly(), batch_size=4, num_workers=2)]
    assert got == [[0, 2, 4, 6], [8, 10]]
    assert [b.tolist() for b in tud.DataLoader(LoadOnly(), batch_size=4)] == got


def test_a_load_method_alone_is_not_taken_as_a_hook():
    """Only StagedDataset, or load *and* preprocess, opt in; __getitem__ stays the stage."""
    ours = [b.tolist() for b in torch_spdl.DataLoader(NoIndexLoad(), batch_size=4, num_workers=2)]
    assert ours == [b.tolist() for b in tud.DataLoader(NoIndexLoad(), batch_size=4)]


@pytest.mark.parametrize(
    "kwargs",
    [{"load_fn": lambda i: i}, {"preprocess_fn": lambda raw: raw}],
    ids=["load_fn", "preprocess_fn"],
)
def test_hooks_with_an_iterable_dataset_are_a_value_error(kwargs):
    with pytest.raises(ValueError, match="IterableDataset"):
        torch_spdl.DataLoader(ITERABLE, **kwargs)


def test_iterable_dataset_methods_named_load_are_ignored():
    loader = torch_spdl.DataLoader(IterableWithLoad(), batch_size=5, num_workers=2)
    assert sorted(b.tolist() for b in loader) == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4]] + [
        [5, 6, 7, 8, 9],
        [5, 6, 7, 8, 9],
    ]  # two unsharded workers, as with torch's worker processes


def test_extras_are_public_attributes_with_defaults():
    loader = torch_spdl.DataLoader(MAP)
    assert loader.io_workers == 16
    assert loader.load_fn is None
    assert loader.preprocess_fn is None


def test_extras_are_stored_as_given():
    def load(i):
        return i

    def preprocess(raw):
        return raw

    loader = torch_spdl.DataLoader(MAP, io_workers=5, load_fn=load, preprocess_fn=preprocess)
    assert (loader.io_workers, loader.load_fn, loader.preprocess_fn) == (5, load, preprocess)


@pytest.mark.parametrize("attr", ["load_fn", "preprocess_fn"])
def test_hooks_are_guarded_after_init_as_torchs_attributes_are(attr):
    """They decide the dataset's stages when the loader is built: assigning one later is refused
    with the wording of torch's guard, and changes nothing."""
    loader = MyLoader(MAP, preprocess_fn=lambda raw: raw)
    before = getattr(loader, attr)
    assert set_error(loader, attr, None) == (
        f"{attr} attribute should not be set after MyLoader is initialized"
    )
    assert getattr(loader, attr) is before


@pytest.mark.parametrize(
    "attr, value, error",
    [
        ("io_workers", 0, ValueError),
        ("uneven_ranks", "even", ValueError),
        ("worker_method", "fiber", ValueError),
        ("worker_nice", -1, ValueError),
        ("worker_nice", 20, ValueError),
        ("worker_nice", True, ValueError),
        ("worker_nice", 1.0, ValueError),
        ("max_failures", -1, ValueError),
        ("max_failures", "1", TypeError),
        ("stats_interval", 0, ValueError),
        ("stall_warning", "1s", ValueError),
        ("device_transform", abs, ValueError),  # needs device= as well
        ("cache_bytes", 10, ValueError),  # MAP has no load hook to cache
    ],
)
def test_an_option_assigned_after_init_is_validated_as_at_init(attr, value, error):
    with pytest.raises(error) as at_init:
        torch_spdl.DataLoader(MAP, **{attr: value})
    loader = torch_spdl.DataLoader(MAP)
    before = loader.options
    with pytest.raises(error) as assigned:
        setattr(loader, attr, value)
    assert str(assigned.value) == str(at_init.value)
    assert loader.options is before  # the refused assignment changed nothing


def test_options_are_one_frozen_object_and_an_assignment_takes_effect_next_pass():
    loader = torch_spdl.DataLoader(MAP, batch_size=5, num_workers=2, worker_method="thread")
    with pytest.raises(AttributeError):
        loader.options.worker_method = "process"
    loader.worker_method = "process"
    assert loader.options.worker_method == "process" and loader.worker_method == "process"
    batches = list(loader)
    assert [b.tolist() for b in batches] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert [report.kind for report in loader.stats().stages] == ["process"]


# -- pin_memory without an accelerator -----------------------------------------------------------
@pytest.mark.skipif(torch.accelerator.is_available(), reason="needs a machine without accelerator")
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("device", ["", "cpu"])
def test_pin_memory_without_accelerator_warns_like_torch(num_workers, device):
    def run(cls):
        loader = cls(
            MAP, batch_size=4, pin_memory=True, pin_memory_device=device, num_workers=num_workers
        )
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            iterator = iter(loader)
            try:
                batches = [b.tolist() for b in iterator]
            except RuntimeError as error:  # torch 2.8 pins on the device it is given: "cpu"
                batches = type(error)
                # torch 2.8's re-raise keeps the error in a local of a frame its traceback
                # holds, and that cycle held torch's iterator, its pinning thread and workers
                # until a collection, in whichever thread it came
                error.__traceback__ = None
            del iterator  # shut down here, in this thread, as the test ends
        # the loader's own warnings (the tensor's deprecation warnings come once per process)
        return batches, [(w.category, str(w.message)) for w in caught if w.category is UserWarning]

    want, got = run(tud.DataLoader), run(torch_spdl.DataLoader)
    assert got == want
    if TORCH_VERSION < (2, 9) and device:
        assert want == (RuntimeError, [])  # no warning, and a pinning that fails, as torch's
        return
    assert want[0] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    message = (
        "'pin_memory' argument is set as true but no accelerator is found, "
        "then device pinned memory won't be used."
    )
    assert (UserWarning, message) in got[1]
