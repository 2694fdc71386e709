from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry
from miles_core.sync.in_process import InProcessTransport


@hookimpl
def miles_register_weight_transports(registry: Registry) -> None:
    registry.add("in_process", lambda ctx: InProcessTransport())
