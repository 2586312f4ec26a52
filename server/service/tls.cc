#include "server/service/tls.h"

#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>

#include <ctime>
#include <memory>
#include <utility>
#include <vector>

#include <glog/logging.h>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/security/tls_certificate_provider.h"
#include "grpcpp/security/tls_credentials_options.h"
#include "prometheus/client_metric.h"
#include "prometheus/collectable.h"
#include "prometheus/metric_family.h"
#include "server/util/files.h"
#include "server/util/status_macros.h"

namespace collabserve::service {
namespace {

// A PEM file bigger than this is not a certificate or a key.
constexpr size_t kMaxPemBytes = size_t{1} << 20;

struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
struct X509Free {
  void operator()(X509* x) const { X509_free(x); }
};
struct PkeyFree {
  void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
};
using X509Ptr = std::unique_ptr<X509, X509Free>;

std::unique_ptr<BIO, BioFree> MemoryBio(const std::string& data) {
  return std::unique_ptr<BIO, BioFree>(BIO_new_mem_buf(data.data(), static_cast<int>(data.size())));
}

// OpenSSL's error queue, emptied, as text (its first reason is enough to name the problem).
std::string OpenSslReason() {
  const unsigned long e = ERR_get_error();  // NOLINT(runtime/int): OpenSSL's type
  ERR_clear_error();
  if (e == 0) return "";
  const char* reason = ERR_reason_error_string(e);
  return reason == nullptr ? "" : absl::StrCat(" (", reason, ")");
}

// A flag's file, its errors prefixed with the flag.
absl::StatusOr<std::string> ReadFlagFile(const char* flag, const std::string& path) {
  absl::StatusOr<std::string> pem = util::ReadFile(path, kMaxPemBytes);
  if (!pem.ok()) {
    return absl::Status(pem.status().code(), absl::StrCat("--", flag, ": ", pem.status().message()));
  }
  return pem;
}

// The first certificate in `pem`; an error naming the flag and file when there is none.
absl::StatusOr<X509Ptr> FirstCertificate(const char* flag, const std::string& path,
                                         const std::string& pem) {
  auto bio = MemoryBio(pem);
  X509Ptr cert(
      bio == nullptr ? nullptr : PEM_read_bio_X509(bio.get(), nullptr, nullptr, nullptr));
  if (cert == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--", flag, " ", path, ": no PEM certificate in it", OpenSslReason()));
  }
  return cert;
}

absl::Time FromAsn1(const ASN1_TIME* t) {
  std::tm tm{};
  if (t == nullptr || ASN1_TIME_to_tm(t, &tm) != 1) return absl::InfinitePast();
  return absl::FromTimeT(timegm(&tm));
}

}  // namespace

absl::Status CheckReloadInterval(absl::Duration interval) {
  if (interval < absl::Seconds(1) || interval > absl::Hours(24)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_reload_s=", absl::ToDoubleSeconds(interval),
                     " is not within 1-86400: the certificate files are read again that often"));
  }
  return absl::OkStatus();
}

absl::StatusOr<CertificateFacts> CheckCertificateFiles(const TlsFiles& files) {
  if (files.cert_file.empty() || files.key_file.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key must be given together");
  }
  RETURN_IF_ERROR(CheckReloadInterval(files.reload_interval));
  ASSIGN_OR_RETURN(const std::string cert_pem, ReadFlagFile("tls_cert", files.cert_file));
  ASSIGN_OR_RETURN(const std::string key_pem, ReadFlagFile("tls_key", files.key_file));
  ERR_clear_error();
  ASSIGN_OR_RETURN(const X509Ptr cert,
                   FirstCertificate("tls_cert", files.cert_file, cert_pem));
  // PKCS#8 ("BEGIN ENCRYPTED PRIVATE KEY") and the older "Proc-Type: 4,ENCRYPTED" header.
  if (absl::StrContains(key_pem, "ENCRYPTED")) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key ", files.key_file,
                     " is encrypted; the server takes an unencrypted key (openssl pkey -in ",
                     files.key_file, " -out PLAIN.key)"));
  }
  // A passphrase callback that gives none: an encrypted key is refused rather than prompted for.
  auto no_passphrase = [](char*, int, int, void*) { return 0; };
  auto key_bio = MemoryBio(key_pem);
  std::unique_ptr<EVP_PKEY, PkeyFree> key(
      key_bio == nullptr ? nullptr
                         : PEM_read_bio_PrivateKey(key_bio.get(), nullptr, no_passphrase, nullptr));
  if (key == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_key ", files.key_file, ": no PEM private key in it", OpenSslReason()));
  }
  if (X509_check_private_key(cert.get(), key.get()) != 1) {
    ERR_clear_error();
    return absl::InvalidArgumentError(absl::StrCat("--tls_key ", files.key_file,
                                                   " is not the key of the certificate in --tls_cert ",
                                                   files.cert_file));
  }
  if (!files.client_ca_file.empty()) {
    ASSIGN_OR_RETURN(const std::string ca_pem, ReadFlagFile("tls_client_ca", files.client_ca_file));
    RETURN_IF_ERROR(FirstCertificate("tls_client_ca", files.client_ca_file, ca_pem).status());
  }
  CertificateFacts facts;
  char subject[512] = {0};
  X509_NAME_oneline(X509_get_subject_name(cert.get()), subject, sizeof(subject));
  facts.subject = subject;
  facts.not_before = FromAsn1(X509_get0_notBefore(cert.get()));
  facts.not_after = FromAsn1(X509_get0_notAfter(cert.get()));
  return facts;
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> FollowedServerCredentials(
    const TlsFiles& files) {
  ASSIGN_OR_RETURN(const CertificateFacts facts, CheckCertificateFiles(files));
  // Served all the same (a renewal may be on its way), but clients will refuse it meanwhile.
  const absl::Time now = absl::Now();
  if (facts.not_after < now) {
    LOG(WARNING) << "--tls_cert " << files.cert_file << " (" << facts.subject << ") expired at "
                 << absl::FormatTime(facts.not_after, absl::UTCTimeZone())
                 << ": clients that check it refuse the connection until it is renewed";
  } else if (facts.not_before > now) {
    LOG(WARNING) << "--tls_cert " << files.cert_file << " (" << facts.subject
                 << ") is not valid before "
                 << absl::FormatTime(facts.not_before, absl::UTCTimeZone())
                 << ": clients that check it refuse the connection until then";
  }
  // Whole seconds, rounded up; CheckCertificateFiles bounds the interval to a day.
  const auto seconds = static_cast<unsigned int>(
      absl::ToInt64Seconds(absl::Ceil(files.reload_interval, absl::Seconds(1))));
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      files.key_file, files.cert_file, files.client_ca_file, seconds);
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (!files.client_ca_file.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  }
  std::shared_ptr<grpc::ServerCredentials> creds = grpc::experimental::TlsServerCredentials(options);
  if (creds == nullptr) return absl::InternalError("gRPC made no TLS server credentials");
  return creds;
}

namespace {

class CertificateCollectable : public prometheus::Collectable {
 public:
  static void AddTime(std::vector<prometheus::MetricFamily>* out, const char* name,
                      const char* help, absl::Time t) {
    if (t == absl::InfinitePast()) return;  // a time OpenSSL could not read
    prometheus::MetricFamily& f = out->emplace_back();
    f.name = name;
    f.help = help;
    f.type = prometheus::MetricType::Gauge;
    prometheus::ClientMetric m;
    m.gauge.value = absl::ToDoubleSeconds(t - absl::UnixEpoch());
    f.metric.push_back(m);
  }

  explicit CertificateCollectable(TlsFiles files) : files_(std::move(files)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const absl::StatusOr<CertificateFacts> facts = CheckCertificateFiles(files_);
    std::vector<prometheus::MetricFamily> out(1);
    out[0].name = "collabserve_tls_certificate_valid";
    out[0].help =
        "1 while the --tls_cert/--tls_key pair on disk parses and matches and --tls_client_ca (if "
        "set) parses (the server reads them again every --tls_reload_s), else 0: with a key "
        "that is not the certificate's or a file that does not parse, new TLS handshakes fail; "
        "with a file missing or unreadable, the last one read keeps serving but the next start "
        "fails.";
    out[0].type = prometheus::MetricType::Gauge;
    prometheus::ClientMetric valid;
    valid.gauge.value = facts.ok() ? 1 : 0;
    out[0].metric.push_back(valid);
    if (facts.ok()) {
      AddTime(&out, "collabserve_tls_certificate_expiry_timestamp_seconds",
              "notAfter of the certificate in --tls_cert, in Unix seconds.", facts->not_after);
      AddTime(&out, "collabserve_tls_certificate_not_before_timestamp_seconds",
              "notBefore of the certificate in --tls_cert, in Unix seconds (with the expiry, its "
              "lifetime: renewals come at two thirds of it).",
              facts->not_before);
    }
    return out;
  }

 private:
  const TlsFiles files_;
};

}  // namespace

std::shared_ptr<prometheus::Collectable> NewCertificateCollectable(TlsFiles files) {
  return std::make_shared<CertificateCollectable>(std::move(files));
}

}  // namespace collabserve::service
