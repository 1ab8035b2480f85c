"""beagle-pipeline's application layer and feature store (`pipeline.store`).

Importing it runs nothing: the dependency check (pipeline/dependency_floors.py) runs at the command entry
points (`beagle-pipeline`, `jobs/*.py`, `python -m pipeline.commands.train`), never in a library import or a
Ray worker."""
