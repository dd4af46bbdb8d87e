"""Built-in storage backends, installed as ``kvoffload.backends``.

Each is registered through the ``kvoffload.backends`` entry-point group in
``pyproject.toml``, exactly as a third-party backend would be; nothing here is
imported until a tier names it.
"""
