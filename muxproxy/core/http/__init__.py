"""HTTP semantics both versions share (RFC 9110): a request's intake and validation, header
translation for a proxy, paths as routes see them, forwarded fields, credentials, the Date
field, and the proxy's own error responses."""
