"""Walking a traced program: every equation of a jaxpr and of the programs nested in it (control
flow, custom derivatives, kernel bodies), for tests that check what a function traces to."""


def equations(jaxpr):
    """The equations of `jaxpr` and of every jaxpr in their parameters, depth first, in order."""
    for e in jaxpr.eqns:
        yield e
        for p in e.params.values():
            for sub in p if isinstance(p, (list, tuple)) else [p]:
                inner = sub if hasattr(sub, "eqns") else getattr(sub, "jaxpr", None)
                if hasattr(inner, "eqns"):
                    yield from equations(inner)
