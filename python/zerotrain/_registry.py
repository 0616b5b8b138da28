"""Which engine trains a parameter: for deepspeed.utils-style helpers that take a parameter alone.
Both held weakly (by identity: a tensor's == is element-wise), so that what is gone is forgotten."""
import weakref

_by_id = {}


def register(engine, named_parameters):
    track(engine)
    ref = weakref.ref(engine)
    for name, p in named_parameters:
        _by_id[id(p)] = (weakref.ref(p), ref, name)


def engine_of(param):
    entry = _by_id.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    engine = entry[1]()
    if engine is None or engine._engine is None:
        return None
    return engine, entry[2]


_engines = weakref.WeakSet()


def track(engine):
    _engines.add(engine)


def destroy_engines():
    """At interpreter exit: every engine's C++ state and its hold on the job's communicator go, so
    that the communicator (and its Gloo threads) ends before Python's teardown."""
    for engine in list(_engines):
        engine._engine = None
        engine.__dict__.pop("_communicator", None)
