from miles_core.data.jsonl import jsonl_factory
from miles_core.data.reasoning_gym import reasoning_gym_factory
from miles_core.data.synthetic import addition_factory, reverse_factory
from miles_core.hookspecs import hookimpl
from miles_core.plugins.registry import Registry


@hookimpl
def miles_register_tasks(registry: Registry) -> None:
    registry.add("addition", addition_factory)
    registry.add("reverse", reverse_factory)
    registry.add("jsonl", jsonl_factory)
    registry.add("reasoning_gym", reasoning_gym_factory)
