// TLS for the gRPC listeners: a certificate and key that are checked at start and then followed
// on disk, so that a renewed certificate (cert-manager writes the Secret, the kubelet swaps the
// mounted files) serves new connections without a restart.
#ifndef COLLABSERVE_SERVER_SERVICE_TLS_H_
#define COLLABSERVE_SERVER_SERVICE_TLS_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace grpc {
class ServerCredentials;
}  // namespace grpc
namespace prometheus {
class Collectable;
}  // namespace prometheus

namespace collabserve::service {

// --tls_cert / --tls_key / --tls_client_ca / --tls_reload_s. Both files set = TLS, both empty =
// plaintext.
struct TlsFiles {
  std::string cert_file;  // PEM certificate chain, the server's own certificate first
  std::string key_file;   // its PEM private key, unencrypted
  // How often the files are read again (whole seconds, rounded up; 1 s to a day); a changed pair
  // serves the connections made after it. gRPC guards against a file read while it is being
  // written (by its modification time), not against a key and certificate from different
  // renewals: replace both at once (the kubelet's symlink swap does), or a mismatched pair may be
  // read and fail handshakes until the next read.
  absl::Duration reload_interval = absl::Seconds(60);
  // Mutual TLS: PEM certificates of the authorities whose client certificates are accepted; a
  // client without one is refused at the handshake. Empty = no client certificate asked for.
  std::string client_ca_file = {};

  // Any file set: TLS (CheckCertificateFiles then wants both of the pair).
  bool enabled() const { return !cert_file.empty() || !key_file.empty() || !client_ca_file.empty(); }
};

// What the certificate says of itself.
struct CertificateFacts {
  std::string subject;  // OpenSSL's one-line form, e.g. "/CN=collabserve.example"
  absl::Time not_before;
  absl::Time not_after;
};

// --tls_reload_s within 1 s to a day (checked with or without TLS, as every flag is).
absl::Status CheckReloadInterval(absl::Duration interval);

// Reads the files and checks that the first certificate parses, that the key parses and is the
// certificate's own, that the client CA file (if any) holds a certificate, and that the reload
// interval is within 1 s to a day. Errors are
// INVALID_ARGUMENT (NOT_FOUND for a missing file) and name the flag and the file. An expired
// certificate passes (FollowedServerCredentials warns).
absl::StatusOr<CertificateFacts> CheckCertificateFiles(const TlsFiles& files);

// Server credentials on `files`, after CheckCertificateFiles (and a warning if the certificate
// is expired or not yet valid): gRPC reads the pair (and the client CA file) again every
// reload_interval, and what changed is used for the handshakes that follow; connections already made keep theirs. Later
// trouble is gRPC's to handle: a file missing or unreadable keeps the last pair read serving (the
// next start fails); a pair that is read but does not work (a key that is not the certificate's,
// bytes that do not parse) makes new handshakes fail until it is mended. The collectable below
// makes both visible.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> FollowedServerCredentials(
    const TlsFiles& files);

// The pair on disk at each scrape:
//   collabserve_tls_certificate_valid                          1 while it checks, else 0;
//   collabserve_tls_certificate_expiry_timestamp_seconds       its notAfter, and
//   collabserve_tls_certificate_not_before_timestamp_seconds   its notBefore (both absent while
//                                                              it does not check).
// An expiry alert on them sees a renewal that never came, and `valid` a renewal that broke the
// pair.
std::shared_ptr<prometheus::Collectable> NewCertificateCollectable(TlsFiles files);

}  // namespace collabserve::service

#endif  // COLLABSERVE_SERVER_SERVICE_TLS_H_
