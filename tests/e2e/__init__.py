"""End-to-end tests: the real ``tinsmith serve`` process driven by the unmodified ``tinker`` SDK.

Run them alone with ``bash scripts/test tests/e2e`` (or ``-m e2e``); leave them out with
``-m 'not e2e'``. PostgreSQL variants are also marked ``postgres`` and skip, with the reason,
when the server on 127.0.0.1:5432 is not reachable; the SDK 0.22.2 test needs
``.venv-sdk-0.22.2``.
"""
