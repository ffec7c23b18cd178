// Exact BatchNorm's layer call and its meeting of the local replicas, without Python in between (see
// batch_norm_native.py, which builds this file and holds what is rare: errors, weights, sums across workers).
//
// The arithmetic is batch_norm_function.py's NumPy path, operation for operation, in the same order and
// precision (float64 sums, statistics rounded to the input's dtype), so both give the same bits; the kernels
// are the same ATen kernels. What changes is where it runs: a layer's forward is one call that releases
// Python's global lock for its whole length, meeting included, and its backward is a C++ autograd node that
// never takes the lock in a normal step. Two replica threads then no longer take turns under the lock at
// each of a ResNet's forty meetings a step.
#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <mutex>
#include <vector>

namespace py = pybind11;
using torch::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

inline void pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Where the local replicas meet. Each meeting has a tag (which layer, which direction); every replica arrives
// with its float64 part, the last one adds the parts in replica order (and has them summed across workers),
// and everyone leaves with the total. Anything out of the ordinary (a replica arriving twice, at another
// meeting, a failure elsewhere, a wait past a poll interval) is handed to the Python hooks, which raise the
// same errors as the Python meetings or return to go on waiting.
class Meeting : public torch::CustomClassHolder {
 public:
  Meeting(int64_t replicas, double poll_s, double spin_s, py::object hooks, bool across)
      : n_(replicas),
        poll_(std::chrono::duration<double>(poll_s)),
        hooks_(std::move(hooks)),
        across_(across),
        spin_ns_(static_cast<int64_t>(spin_s * 1e9)),
        parts_(replicas),
        present_(replicas, 0),
        here_(replicas, 0),
        weights_(replicas, 0.0),
        weight_known_(replicas, 0),
        spent_(replicas, 0) {}

  ~Meeting() override {
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      hooks_ = py::object();
    } else {
      hooks_.release();  // the interpreter is gone: nothing left to release the reference to
    }
  }

  // At the start of each step (the Python lock held, no replica running).
  void reset(bool timing) {
    std::lock_guard<std::mutex> lock(mu_);
    arrived_ = 0;
    std::fill(here_.begin(), here_.end(), 0);
    std::fill(weight_known_.begin(), weight_known_.end(), 0);
    failed_ = false;
    timing_ = timing;
    if (timing) {
      std::fill(spent_.begin(), spent_.end(), 0);
      meetings_ = 0;
      last_end_ = 0;
    }
  }

  // `replica` declared a loss weight: its next backward meeting asks Python again.
  void forget_weight(int64_t replica) {
    TORCH_CHECK(0 <= replica && replica < n_, "stratagem: local replica ", replica, " of ", n_);
    std::lock_guard<std::mutex> lock(mu_);
    weight_known_[replica] = 0;
  }

  py::tuple times() {
    std::lock_guard<std::mutex> lock(mu_);
    return py::make_tuple(meetings_, spent_, last_end_);
  }

  // The combination weight of `replica`, asked of Python once per step and replica, and again after the replica
  // declares one (`forget_weight`).
  double share(int64_t replica, int64_t tag, bool has, int64_t batch) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (weight_known_[replica]) {
        return weights_[replica];
      }
    }
    double value;
    {
      py::gil_scoped_acquire gil;
      value = hooks_.attr("share")(replica, tag, has, batch).cast<double>();
    }
    std::lock_guard<std::mutex> lock(mu_);
    weights_[replica] = value;
    weight_known_[replica] = 1;
    return value;
  }

  // A global batch of one value per channel: Python raises torch's error, naming the layer.
  void too_small(int64_t replica, int64_t tag, double size, const Tensor& x) {
    py::gil_scoped_acquire gil;
    hooks_.attr("too_small")(replica, tag, size, py::tuple(py::cast(x.sizes().vec())));
    throw std::logic_error("stratagem: the BatchNorm hook did not raise for a batch of one value per channel");
  }

  int64_t replicas() const {
    return n_;
  }

  std::vector<double> meet(int64_t replica, int64_t tag, std::vector<double> part, bool has) {
    const int64_t start = timing_ ? now_ns() : 0;
    std::unique_lock<std::mutex> lock(mu_);
    try {
      return arrive_and_wait(lock, replica, tag, std::move(part), has, start);
    } catch (...) {
      if (!lock.owns_lock()) {
        lock.lock();
      }
      failed_ = true;  // the others wake now instead of at their next poll
      cv_.notify_all();
      throw;
    }
  }

 private:
  std::vector<double> arrive_and_wait(
      std::unique_lock<std::mutex>& lock,
      int64_t replica,
      int64_t tag,
      std::vector<double> part,
      bool has,
      int64_t start) {
    if (failed_ || here_[replica] || (arrived_ > 0 && tag != tag_)) {
      const bool twice = here_[replica];
      const int64_t other = arrived_ > 0 ? tag_ : tag;
      check(lock, replica, tag, other, twice, failed_, 0.0);
      throw std::logic_error("stratagem: the BatchNorm meeting's check did not raise for a failed meeting");
    }
    if (arrived_ == 0) {
      tag_ = tag;
    }
    here_[replica] = 1;
    present_[replica] = has ? 1 : 0;
    parts_[replica] = std::move(part);
    const uint64_t generation = generation_;
    if (++arrived_ == n_) {
      std::vector<double> total = add_parts();
      if (across_) {
        lock.unlock();
        {
          py::gil_scoped_acquire gil;
          auto view = torch::from_blob(
              total.data(), {static_cast<int64_t>(total.size())}, torch::TensorOptions().dtype(torch::kFloat64));
          hooks_.attr("across")(view, tag);
        }
        lock.lock();
      }
      result_[generation % 2] = total;
      arrived_ = 0;
      std::fill(here_.begin(), here_.end(), 0);
      ++generation_;
      cv_.notify_all();
      record(replica, start);
      return total;
    }
    const int64_t since = now_ns();
    if (spin_ns_ > 0) {
      // The last replica is usually a few microseconds to a millisecond away: watching for it on this replica's
      // own core (idle until then anyway) returns as soon as it arrives, instead of after an operating-system
      // wake-up (tens of microseconds a meeting on a VM).
      lock.unlock();
      while (generation_.load(std::memory_order_acquire) == generation && !failed_.load(std::memory_order_acquire) &&
             now_ns() - since < spin_ns_) {
        pause();
      }
      lock.lock();
    }
    while (generation_ == generation) {
      if (failed_) {
        check(lock, replica, tag, tag, false, true, 0.0);
        throw std::logic_error("stratagem: the BatchNorm meeting's check did not raise after a failure");
      }
      if (!cv_.wait_for(lock, poll_, [&] { return generation_ != generation || failed_; })) {
        check(lock, replica, tag, tag, false, false, static_cast<double>(now_ns() - since) * 1e-9);
      }
    }
    std::vector<double> total = result_[generation % 2];
    record(replica, start);
    return total;
  }

  // Every replica's part has the meeting's size (zeros where it brings no examples); the present ones count.
  std::vector<double> add_parts() const {
    const size_t size = parts_[0].size();
    std::vector<double> total(size, 0.0);
    for (int64_t r = 0; r < n_; ++r) {
      if (!present_[r]) {
        continue;
      }
      const std::vector<double>& p = parts_[r];
      for (size_t i = 0; i < size; ++i) {
        total[i] += p[i];
      }
    }
    return total;
  }

  // With the meeting's lock held on entry and on a normal return: Python decides whether anything is wrong.
  void check(
      std::unique_lock<std::mutex>& lock,
      int64_t replica,
      int64_t tag,
      int64_t other,
      bool twice,
      bool failed,
      double waited) {
    std::vector<int64_t> arrived;
    for (int64_t r = 0; r < n_; ++r) {
      if (here_[r]) {
        arrived.push_back(r);
      }
    }
    lock.unlock();
    {
      py::gil_scoped_acquire gil;
      hooks_.attr("check")(replica, tag, other, arrived, twice, failed, waited);
    }
    lock.lock();
  }

  void record(int64_t replica, int64_t start) {
    if (!timing_) {
      return;
    }
    const int64_t end = now_ns();
    spent_[replica] += end - start;
    if (replica == 0) {
      ++meetings_;
    }
    last_end_ = std::max(last_end_, end);
  }

  const int64_t n_;
  const std::chrono::duration<double> poll_;
  py::object hooks_;
  const bool across_;
  std::mutex mu_;
  std::condition_variable cv_;
  int64_t arrived_ = 0;
  std::atomic<uint64_t> generation_{0};
  int64_t tag_ = -1;
  std::atomic<bool> failed_{false};
  const int64_t spin_ns_;
  std::vector<std::vector<double>> parts_;
  std::vector<char> present_;
  std::vector<char> here_;
  std::vector<double> result_[2];
  std::vector<double> weights_;
  std::vector<char> weight_known_;
  bool timing_ = false;
  std::vector<int64_t> spent_;
  int64_t meetings_ = 0;
  int64_t last_end_ = 0;
};

// [sum, sum of squares, count] per channel in float64 from the slice's mean and biased variance
// (batch_norm_function._forward_part).
template <typename T>
std::vector<double> forward_part(const Tensor& mean, const Tensor& var, int64_t count) {
  const int64_t channels = mean.size(0);
  const T* m = mean.data_ptr<T>();
  const T* v = var.data_ptr<T>();
  std::vector<double> part(2 * channels + 1);
  const double n = static_cast<double>(count);
  for (int64_t c = 0; c < channels; ++c) {
    const double mc = static_cast<double>(m[c]);
    part[c] = mc * n;
    part[channels + c] = (static_cast<double>(v[c]) + mc * mc) * n;
  }
  part[2 * channels] = n;
  return part;
}

// The global mean and biased variance in T, 1 / sqrt(var + eps) in T, and the unbiased variance for the
// running buffers (batch_norm_function._forward_statistics).
template <typename T>
void statistics(const std::vector<double>& total, double eps, Tensor& mean, Tensor& var, Tensor& invstd, Tensor& unbiased) {
  const int64_t channels = mean.size(0);
  const double size = total[2 * channels];
  T* pm = mean.data_ptr<T>();
  T* pv = var.data_ptr<T>();
  T* pi = invstd.data_ptr<T>();
  T* pu = unbiased.data_ptr<T>();
  const T teps = static_cast<T>(eps);
  const double correction = size / (size - 1);
  for (int64_t c = 0; c < channels; ++c) {
    const double mean64 = total[c] / size;
    double var64 = total[channels + c] / size;
    var64 -= mean64 * mean64;
    if (var64 < 0.0) {
      var64 = 0.0;
    }
    pm[c] = static_cast<T>(mean64);
    pv[c] = static_cast<T>(var64);
    pi[c] = static_cast<T>(1) / std::sqrt(static_cast<T>(pv[c] + teps));
    pu[c] = static_cast<T>(var64 * correction);
  }
}

template <typename T>
std::vector<double> backward_part(const Tensor& sum_dy, const Tensor& sum_dy_xhat, double share) {
  const int64_t channels = sum_dy.size(0);
  const T* a = sum_dy.data_ptr<T>();
  const T* b = sum_dy_xhat.data_ptr<T>();
  std::vector<double> part(2 * channels);
  for (int64_t c = 0; c < channels; ++c) {
    part[c] = static_cast<double>(a[c]) * share;
    part[channels + c] = static_cast<double>(b[c]) * share;
  }
  return part;
}

// The replica's gain w / sigma and its shift and scale -(w / sigma) * (a, c) / share
// (batch_norm_function._coefficients).
template <typename T>
void coefficients(
    const std::vector<double>& total,
    double share,
    double size,
    const Tensor& invstd,
    const Tensor& weight,
    Tensor& gain,
    Tensor& shift,
    Tensor& scale) {
  const int64_t channels = invstd.size(0);
  const T* pi = invstd.data_ptr<T>();
  const T* pw = weight.defined() ? weight.data_ptr<T>() : nullptr;
  T* pg = gain.data_ptr<T>();
  T* ps = shift.data_ptr<T>();
  T* pc = scale.data_ptr<T>();
  const double denominator = share * -size;
  for (int64_t c = 0; c < channels; ++c) {
    const T g = pw != nullptr ? static_cast<T>(pi[c] * pw[c]) : pi[c];
    pg[c] = g;
    ps[c] = static_cast<T>(g * static_cast<T>(total[c] / denominator));
    pc[c] = static_cast<T>(g * static_cast<T>(total[channels + c] / denominator));
  }
}

// The input gradient in one pass over a contiguous (N, C, *) slice: dx = x * alpha + beta + dy * gain per
// channel, where the two passes it replaces (ATen's eval-mode batch norm of x with the scale and shift, then
// `addcmul_(dy, gain)`) make two. Built only where torch runs its AVX2 or AVX-512 kernels, and with -mfma
// (batch_norm_native.py): there ATen forms alpha = invstd * scale in the input's dtype and beta = shift -
// mean * alpha with one rounding, and adds each product with a fused multiply-add, and so does this, which keeps
// the Python meetings' bits (tests/test_batch_norm_native.py).
#ifdef STRATAGEM_FUSED_INPUT_GRADIENT
constexpr bool kFusedInputGradient = true;
#else
constexpr bool kFusedInputGradient = false;
#endif

template <typename T>
Tensor input_gradient(
    const Tensor& x,
    const Tensor& dy,
    const Tensor& mean,
    const Tensor& var,
    double eps,
    const Tensor& gain,
    const Tensor& shift,
    const Tensor& scale) {
  const int64_t batch = x.size(0);
  const int64_t channels = x.size(1);
  const int64_t inner = channels == 0 || batch == 0 ? 0 : x.numel() / (batch * channels);
  std::vector<T> alpha(channels);
  std::vector<T> beta(channels);
  const T* pm = mean.data_ptr<T>();
  const T* pv = var.data_ptr<T>();
  const T* ps = shift.data_ptr<T>();
  const T* pc = scale.data_ptr<T>();
  for (int64_t c = 0; c < channels; ++c) {
    const T invstd = static_cast<T>(1) / std::sqrt(pv[c] + static_cast<T>(eps));
    alpha[c] = invstd * pc[c];
    beta[c] = std::fma(-pm[c], alpha[c], ps[c]);
  }
  Tensor out = at::empty_like(x);
  const T* px = x.data_ptr<T>();
  const T* pdy = dy.data_ptr<T>();
  const T* pg = gain.data_ptr<T>();
  T* po = out.data_ptr<T>();
  at::parallel_for(0, batch * channels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const int64_t c = row % channels;
      const T a = alpha[c];
      const T b = beta[c];
      const T g = pg[c];
      const T* xr = px + row * inner;
      const T* dyr = pdy + row * inner;
      T* outr = po + row * inner;
      for (int64_t i = 0; i < inner; ++i) {
        outr[i] = std::fma(dyr[i], g, std::fma(xr[i], a, b));
      }
    }
  });
  return out;
}

// ATen's optional arguments take an absent weight as std::nullopt, not as an undefined tensor.
std::optional<Tensor> optional(const Tensor& t) {
  return t.defined() ? std::optional<Tensor>(t) : std::nullopt;
}

c10::intrusive_ptr<Meeting> meeting_of(AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<Meeting>(ctx->saved_data["meeting"].toCapsule());
}

struct GlobalBatchNorm : public torch::autograd::Function<GlobalBatchNorm> {
  // `needs_input_grad` counts the tensors given (an absent weight or bias is none): x is 0, the weight 1 when
  // given, the bias after it.
  static Tensor forward(
      AutogradContext* ctx,
      Tensor x,
      std::optional<Tensor> weight,
      std::optional<Tensor> bias,
      std::optional<Tensor> running_mean,
      std::optional<Tensor> running_var,
      c10::intrusive_ptr<Meeting> meeting,
      int64_t replica,
      int64_t tag,
      bool standing_in,
      double factor,
      double eps) {
    const int64_t channels = x.size(1);
    std::vector<double> part;
    if (standing_in) {
      part.assign(2 * channels + 1, 0.0);  // a stand-in example counts as no example
    } else {
      auto [mean, var] = at::batch_norm_update_stats(x, std::nullopt, std::nullopt, 0.0);  // biased variance
      const int64_t count = x.numel() / channels;
      part = x.scalar_type() == at::kFloat ? forward_part<float>(mean, var, count)
                                           : forward_part<double>(mean, var, count);
    }
    const std::vector<double> total = meeting->meet(replica, tag, std::move(part), !standing_in);
    const double size = total[2 * channels];
    if (size <= 1) {
      meeting->too_small(replica, tag, size, x);
    }
    auto options = x.options();
    Tensor mean = at::empty({channels}, options);
    Tensor var = at::empty({channels}, options);
    Tensor invstd = at::empty({channels}, options);
    Tensor unbiased = at::empty({channels}, options);
    if (x.scalar_type() == at::kFloat) {
      statistics<float>(total, eps, mean, var, invstd, unbiased);
    } else {
      statistics<double>(total, eps, mean, var, invstd, unbiased);
    }
    if (running_mean.has_value() && running_var.has_value()) {
      running_mean->lerp_(mean, factor);
      running_var->lerp_(unbiased, factor);
    }
    Tensor y = std::get<0>(at::native_batch_norm(x, weight, bias, mean, var, false, 0.0, eps));
    ctx->save_for_backward({x, weight.value_or(Tensor()), mean, var, invstd});
    ctx->saved_data["weight_index"] = weight.has_value() ? int64_t{1} : int64_t{-1};
    ctx->saved_data["bias_index"] = bias.has_value() ? int64_t{weight.has_value() ? 2 : 1} : int64_t{-1};
    ctx->saved_data["meeting"] = c10::IValue::make_capsule(meeting);
    ctx->saved_data["replica"] = replica;
    ctx->saved_data["tag"] = tag;
    ctx->saved_data["standing_in"] = standing_in;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["size"] = size;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const Tensor& x = saved[0];
    const Tensor& weight = saved[1];
    const Tensor& mean = saved[2];
    const Tensor& var = saved[3];
    const Tensor& invstd = saved[4];
    const bool standing_in = ctx->saved_data["standing_in"].toBool();
    const double eps = ctx->saved_data["eps"].toDouble();
    Tensor dy = grads[0].contiguous();
    // Local sums: sum dy, and sum dy * x_hat (x_hat normalised with the global statistics).
    auto [unused, sum_dy_xhat, sum_dy] =
        at::native_batch_norm_backward(dy, x, optional(weight), mean, var, {}, {}, false, eps, {false, true, true});
    Tensor grad_x, grad_weight, grad_bias;
    const int64_t weight_index = ctx->saved_data["weight_index"].toInt();
    const int64_t bias_index = ctx->saved_data["bias_index"].toInt();
    if (weight_index >= 0 && ctx->needs_input_grad(weight_index)) {
      grad_weight = standing_in ? at::zeros_like(sum_dy_xhat) : sum_dy_xhat;
    }
    if (bias_index >= 0 && ctx->needs_input_grad(bias_index)) {
      grad_bias = standing_in ? at::zeros_like(sum_dy) : sum_dy;
    }
    if (ctx->needs_input_grad(0)) {
      auto meeting = meeting_of(ctx);
      const int64_t replica = ctx->saved_data["replica"].toInt();
      const int64_t tag = ctx->saved_data["tag"].toInt() + 1;  // the backward meeting of the layer
      const int64_t channels = x.size(1);
      // Python refuses a weight of 0 on a slice with examples; a stand-in brings nothing whatever its weight.
      const double share = meeting->share(replica, tag, !standing_in, x.size(0));
      std::vector<double> part;
      if (standing_in) {
        part.assign(2 * channels, 0.0);
      } else {
        part = x.scalar_type() == at::kFloat ? backward_part<float>(sum_dy, sum_dy_xhat, share)
                                             : backward_part<double>(sum_dy, sum_dy_xhat, share);
      }
      const std::vector<double> total = meeting->meet(replica, tag, std::move(part), !standing_in);
      if (standing_in) {
        grad_x = at::zeros_like(x);  // a stand-in's gradient is never read
      } else {
        auto options = x.options();
        Tensor gain = at::empty({channels}, options);
        Tensor shift = at::empty({channels}, options);
        Tensor scale = at::empty({channels}, options);
        const double size = ctx->saved_data["size"].toDouble();
        if (x.scalar_type() == at::kFloat) {
          coefficients<float>(total, share, size, invstd, weight, gain, shift, scale);
        } else {
          coefficients<double>(total, share, size, invstd, weight, gain, shift, scale);
        }
        // dx = w/sigma * (dy - a - x_hat * c), a and c the global weighted means of dy and dy * x_hat, over share.
        if (kFusedInputGradient && x.is_contiguous() && dy.is_contiguous()) {
          grad_x = x.scalar_type() == at::kFloat ? input_gradient<float>(x, dy, mean, var, eps, gain, shift, scale)
                                                 : input_gradient<double>(x, dy, mean, var, eps, gain, shift, scale);
        } else {  // another memory layout (channels last): the same terms through ATen's kernels, in two passes
          std::vector<int64_t> shape(x.dim(), 1);
          shape[1] = channels;
          grad_x = std::get<0>(at::native_batch_norm(x, scale, shift, mean, var, false, 0.0, eps));
          grad_x.addcmul_(dy, gain.view(shape));
        }
      }
    }
    return {grad_x, grad_weight, grad_bias, Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor global_batch_norm(
    const c10::intrusive_ptr<Meeting>& meeting,
    const Tensor& x,
    const std::optional<Tensor>& weight,
    const std::optional<Tensor>& bias,
    const std::optional<Tensor>& running_mean,
    const std::optional<Tensor>& running_var,
    int64_t replica,
    int64_t tag,
    bool standing_in,
    double factor,
    double eps) {
  TORCH_CHECK(
      0 <= replica && replica < meeting->replicas(),
      "stratagem: local replica ",
      replica,
      " at a meeting of ",
      meeting->replicas(),
      " replica(s)");
  return GlobalBatchNorm::apply(
      x,
      weight,
      bias,
      running_mean,
      running_var,
      meeting,
      replica,
      tag,
      standing_in,
      factor,
      eps);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Meeting, c10::intrusive_ptr<Meeting>>(m, "Meeting")
      .def(py::init<int64_t, double, double, py::object, bool>())
      .def("reset", &Meeting::reset)
      .def("forget_weight", &Meeting::forget_weight)
      .def("times", &Meeting::times);
  m.def("global_batch_norm", &global_batch_norm, py::call_guard<py::gil_scoped_release>());
  m.attr("fused_input_gradient") = kFusedInputGradient;
  // For the tests: the one-pass input gradient, to compare with the two passes it replaces.
  m.def("input_gradient", [](const Tensor& x, const Tensor& dy, const Tensor& mean, const Tensor& var, double eps,
                             const Tensor& gain, const Tensor& shift, const Tensor& scale) {
    TORCH_CHECK(x.is_contiguous() && dy.is_contiguous(), "input_gradient takes contiguous tensors");
    return x.scalar_type() == at::kFloat ? input_gradient<float>(x, dy, mean, var, eps, gain, shift, scale)
                                         : input_gradient<double>(x, dy, mean, var, eps, gain, shift, scale);
  });
}
