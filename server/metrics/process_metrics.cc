#include "server/metrics/process_metrics.h"

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/registry.h"

namespace collabserve::metrics {
namespace {

struct ProcessFamilies {
  std::shared_ptr<prometheus::Registry> registry = std::make_shared<prometheus::Registry>();
  prometheus::Family<prometheus::Counter>& load_failures =
      prometheus::BuildCounter()
          .Name("collabserve_repository_load_failures_total")
          .Help("Version directories the model repository could not load, by model and reason "
                "(the load error's status code).")
          .Register(*registry);
};

ProcessFamilies& Families() {
  static ProcessFamilies* families = new ProcessFamilies();  // never destroyed: used at exit
  return *families;
}

}  // namespace

void CountRepositoryLoadFailure(const std::string& model, const std::string& reason) {
  // Family::Add is thread-safe and returns the existing series for known labels.
  Families().load_failures.Add({{"model", model}, {"reason", reason}}).Increment();
}

std::shared_ptr<prometheus::Collectable> ProcessCollectable() { return Families().registry; }

}  // namespace collabserve::metrics
