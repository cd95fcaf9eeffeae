"""Higher-order ops that keep user regions, with their placements, through to the backend.

Not built yet (issue #4: ``local_map``).
"""

__all__: list[str] = []
