"""Code that runs under the AppWorld interpreter, inside the sandboxes (see `seeupo_gym.appworld.sandbox`).

These modules import nothing of `seeupo_gym` (the AppWorld interpreter does not have it): they
are run as scripts, `python -P <this folder>/cells.py`, and import each other by file name.
`wire` is also imported by the host side.
"""
