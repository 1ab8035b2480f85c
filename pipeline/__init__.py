"""beagle-pipeline's application layer and feature store (`pipeline.store`). Importing it checks that no
installed dependency is older than the code needs (pipeline/dependency_floors.py)."""
from pipeline.dependency_floors import check_floors

check_floors()
