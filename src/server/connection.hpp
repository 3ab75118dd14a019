// Noticing that the client of a non-streaming request has gone.
//
// Debian 12's cpp-httplib (0.11.4) has no Request::is_connection_closed and
// hands a handler no socket; a streaming response probes its DataSink, but
// a plain one has nothing to probe. The Request does carry both ends'
// addresses, so the handler finds its own connection's descriptor among the
// process's sockets (the connection stays open while its handler runs, so
// the descriptor cannot be reused meanwhile) and polls it.
#pragma once

#include <string>

namespace kvcodec::server {

// The socket whose local port is local_port and whose peer is
// remote_addr:remote_port (as httplib::Request reports them); -1 if none.
int find_connection_fd(const std::string& remote_addr, int remote_port, int local_port);

// Whether the peer of `fd` has closed or reset the connection (poll + a
// non-blocking peek: end of stream or an error). Never blocks, never reads.
bool peer_closed(int fd);

}  // namespace kvcodec::server
