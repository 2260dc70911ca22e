"""The driver: a thin Ray actor (actor.py) over pure classes for admission,
publication, fleet monitoring and the event log. Importing the package imports no
Ray: `from areal_ray.driver import Driver` loads the actor module on first use."""


def __getattr__(name):
    if name == "Driver":
        from areal_ray.driver.actor import Driver
        return Driver
    raise AttributeError(name)
