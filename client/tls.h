// TLS as collabserve's clients speak it: the server's certificate verified against roots and, for
// a server with --tls_client_ca (mutual TLS), a certificate of the client's own.
#ifndef COLLABSERVE_CLIENT_TLS_H_
#define COLLABSERVE_CLIENT_TLS_H_

#include <memory>
#include <string>

#include "grpcpp/security/credentials.h"

namespace collabserve::client {

struct ClientTls {
  bool enabled = false;         // TLS, as the server's --tls_cert / --tls_key offer it
  std::string root_certs_pem;   // roots that verify the server; empty = the system's roots
  std::string cert_chain_pem;   // mutual TLS: the client's certificate chain, with its key
  std::string private_key_pem;  // (both empty: no client certificate)
};

inline std::shared_ptr<grpc::ChannelCredentials> ChannelCredentials(const ClientTls& tls) {
  if (!tls.enabled) return grpc::InsecureChannelCredentials();
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = tls.root_certs_pem;
  ssl.pem_cert_chain = tls.cert_chain_pem;
  ssl.pem_private_key = tls.private_key_pem;
  return grpc::SslCredentials(ssl);
}

}  // namespace collabserve::client

#endif  // COLLABSERVE_CLIENT_TLS_H_
