"""`beagle-pipeline extract`: target hidden states into a feature store, on Ray. See docs/extract.md."""
