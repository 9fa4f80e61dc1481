"""A raw HTTP/2 gRPC client on a Unix socket (the h2 package), for clients
that grpcio cannot imitate: one that never reads its answers (flow-control
window 0), or one that floods headers."""
import socket
import struct

import h2.config
import h2.connection
import h2.events
import h2.settings


class RawConn:
    def __init__(self, path, window=65535):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.local_settings = h2.settings.Settings(
            client=True, initial_values={h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: window})
        self.conn.initiate_connection()
        self.flush()

    def flush(self):
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def unary(self, method, payload):
        """Starts a unary call; returns its stream id (the answer is not read)."""
        sid = self.conn.get_next_available_stream_id()
        self.conn.send_headers(sid, [(":method", "POST"), (":scheme", "http"), (":path", method),
                                     (":authority", "localhost"), ("te", "trailers"),
                                     ("content-type", "application/grpc")])
        self.conn.send_data(sid, b"\x00" + struct.pack(">I", len(payload)) + payload,
                            end_stream=True)
        self.flush()
        return sid

    def status_of(self, sid, timeout=10):
        """Reads until stream `sid` ends; returns (grpc-status, grpc-message)
        without ever acknowledging data (the window stays where it is)."""
        self.sock.settimeout(timeout)
        while True:
            for ev in self.conn.receive_data(self.sock.recv(65536)):
                if isinstance(ev, h2.events.TrailersReceived) and ev.stream_id == sid:
                    h = dict((k.decode() if isinstance(k, bytes) else k,
                              v.decode() if isinstance(v, bytes) else v) for k, v in ev.headers)
                    return int(h.get("grpc-status", -1)), h.get("grpc-message", "")
                if isinstance(ev, h2.events.ResponseReceived) and ev.stream_id == sid:
                    h = dict((k.decode() if isinstance(k, bytes) else k,
                              v.decode() if isinstance(v, bytes) else v) for k, v in ev.headers)
                    if "grpc-status" in h:  # trailers-only answer
                        return int(h["grpc-status"]), h.get("grpc-message", "")
            self.flush()

    def close(self):
        self.sock.close()
