"""Byte tunnels: the WebSocket handshake (HTTP/1.1 Upgrade and RFC 8441) and the tunnel it
becomes."""
