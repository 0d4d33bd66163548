"""The gateway's HTTP routes, one module per resource: files, batches, completions (chat and text), responses,
embeddings, jobs, models, the webhook secret, and the service's own (health, schema).

Every route of the API lives here (tests/deploy/test_layout.py checks); the modules are thin: the work is in
files/, batches/, live/ and webhooks/. The dashboard's pages are their own room (ui/).
"""

from __future__ import annotations

from fastapi import APIRouter

from gateway.api import batches, completions, embeddings, files, jobs, models, responses, service, webhook_secret

ROUTERS: tuple[APIRouter, ...] = tuple(m.router for m in (files, batches, completions, responses, embeddings, jobs,
                                                          models, service, webhook_secret))
