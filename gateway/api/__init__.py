"""The gateway's HTTP side: the OpenAI endpoints, request checks, keys, admission, the pages and the process state they
share."""
