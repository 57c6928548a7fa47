"""OpenAI's Responses API (`POST /v1/responses`, `GET` / `DELETE /v1/responses/{id}`) over the chat path.

`schemas` (the request, its input items, the Response object), `convert` (a Responses request as a chat request;
the parameters that are a 400), `output` (output items and the typed stream events), `store` (stored responses for
`previous_response_id`: process memory, bounded, with a TTL), `routes` (the endpoints; `install(app, config)`).
"""
