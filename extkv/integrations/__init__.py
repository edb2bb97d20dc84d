"""extkv inside other libraries' engines.

Each module here adapts one library and imports it, so none is imported by
`import extkv`: the library is an optional dependency, installed with the
extra of the same name (`pip install 'extkv[transformers]'` for
`extkv.integrations.transformers`).
"""
