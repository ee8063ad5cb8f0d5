"""Fixtures of the API tests: PostgreSQL schemas (or a visible skip), shared with the store tests."""

from tests.store.conftest import postgres  # noqa: F401 - re-exported as a fixture of this folder
