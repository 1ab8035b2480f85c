"""The click commands of `beagle-pipeline` that drive the library (train, eval, export, and the store
commands), with the one place that turns the library's errors into exit statuses (errors.py). Progress bars
and plots live here too: the library reports progress through callbacks and never imports click, tqdm or
matplotlib."""
