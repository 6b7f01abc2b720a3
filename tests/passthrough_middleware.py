"""A middleware of the function form that ``vllm serve --middleware`` takes, doing nothing: what a
deployment adds for its logging or metrics. Starlette runs such a middleware as a
``BaseHTTPMiddleware``, which ends a streamed body that its app left open."""


async def passthrough(request, call_next):
    return await call_next(request)
