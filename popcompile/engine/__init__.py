"""The engine-folder contract: what an exporter writes and every runtime reads (README.md in this folder).

    manifest.py   popcompile.json: EngineManifest, GraphEntry, format numbers, safe file lookup
    kv.py         KVLayout: the one KV buffer both graphs and every runtime share
    tensorrt.py   the manifest's "tensorrt" section: TrtSection, Profile, ShapeRange, require_gpu

Nothing is imported here: ``import popcompile.engine`` loads only this docstring.
"""
