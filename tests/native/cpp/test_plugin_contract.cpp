// Black-box build-time checks of libdhisparse_trt_plugins.so, without a GPU and without TensorRT's builder:
// the library is dlopen'ed, its creators come from getCreators(), and every creator is checked for its
// identity and fields, output types and shapes (through a constant-folding IExprBuilder), supported formats,
// configuration checks, aliasing, and the serialization round trip (getFieldsToSerialize -> createPlugin in
// the runtime phase -> same fields, same answers). Usage: test_plugin_contract <path to the library>.
#include "check.h"

#include <NvInferRuntime.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <string>
#include <vector>

namespace
{

using nvinfer1::DataType;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::IDimensionExpr;
using nvinfer1::PluginCapabilityType;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::TensorFormat;

//! A constant dimension expression.
class ConstantDim : public IDimensionExpr
{
public:
    explicit ConstantDim(int64_t value)
        : mValueImpl(value)
    {
        mImpl = &mValueImpl;
    }

private:
    class Impl : public nvinfer1::apiv::VDimensionExpr
    {
    public:
        explicit Impl(int64_t value)
            : mValue(value)
        {
        }
        bool isConstant() const override
        {
            return true;
        }
        int64_t getConstantValue() const override
        {
            return mValue;
        }
        bool isSizeTensor() const override
        {
            return false;
        }

    private:
        int64_t mValue;
    };
    Impl mValueImpl;
};

//! IExprBuilder over constants only: what TensorRT does once every input shape is known.
class ConstantExprBuilder : public nvinfer1::IExprBuilder
{
public:
    ConstantExprBuilder()
    {
        mImpl = &mBuilder;
    }

    IDimensionExpr const* make(int64_t value)
    {
        return mBuilder.constant(value);
    }

private:
    class Impl : public nvinfer1::apiv::VExprBuilder
    {
    public:
        IDimensionExpr const* constant(int64_t value) override
        {
            mDims.emplace_back(value);
            return &mDims.back();
        }
        IDimensionExpr const* operation(
            nvinfer1::DimensionOperation op, IDimensionExpr const& a, IDimensionExpr const& b) override
        {
            int64_t const x = a.getConstantValue();
            int64_t const y = b.getConstantValue();
            switch (op)
            {
            case nvinfer1::DimensionOperation::kSUM: return constant(x + y);
            case nvinfer1::DimensionOperation::kPROD: return constant(x * y);
            case nvinfer1::DimensionOperation::kMAX: return constant(x > y ? x : y);
            case nvinfer1::DimensionOperation::kMIN: return constant(x < y ? x : y);
            case nvinfer1::DimensionOperation::kSUB: return constant(x - y);
            case nvinfer1::DimensionOperation::kEQUAL: return constant(x == y);
            case nvinfer1::DimensionOperation::kLESS: return constant(x < y);
            case nvinfer1::DimensionOperation::kFLOOR_DIV: return constant(x / y);
            case nvinfer1::DimensionOperation::kCEIL_DIV: return constant((x + y - 1) / y);
            }
            return nullptr;
        }
        IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override
        {
            return nullptr;
        }

    private:
        std::deque<ConstantDim> mDims;
    };
    Impl mBuilder;
};

using Shape = std::vector<int64_t>;

//! A plugin under test and its three capability interfaces.
struct Plugin
{
    nvinfer1::IPluginV3* plugin = nullptr;
    nvinfer1::IPluginV3OneCore* core = nullptr;
    nvinfer1::IPluginV3OneBuild* build = nullptr;
    nvinfer1::IPluginV3OneRuntime* runtime = nullptr;

    explicit Plugin(nvinfer1::IPluginV3* p)
        : plugin(p)
    {
        if (p != nullptr)
        {
            core = static_cast<nvinfer1::IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE));
            build = static_cast<nvinfer1::IPluginV3OneBuild*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
            runtime
                = static_cast<nvinfer1::IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
        }
    }
    Plugin(Plugin const&) = delete;
    Plugin& operator=(Plugin const&) = delete;
    ~Plugin()
    {
        delete plugin;
    }

    std::vector<Shape> output_shapes(std::vector<Shape> const& inputs)
    {
        ConstantExprBuilder builder;
        std::vector<DimsExprs> in(inputs.size());
        for (size_t i = 0; i < inputs.size(); ++i)
        {
            in[i].nbDims = static_cast<int32_t>(inputs[i].size());
            for (size_t d = 0; d < inputs[i].size(); ++d)
            {
                in[i].d[d] = builder.make(inputs[i][d]);
            }
        }
        std::vector<DimsExprs> out(static_cast<size_t>(build->getNbOutputs()));
        int32_t const rc = build->getOutputShapes(in.data(), static_cast<int32_t>(in.size()), nullptr, 0, out.data(),
            static_cast<int32_t>(out.size()), builder);
        DHS_CHECK_EQ(rc, 0);
        std::vector<Shape> shapes;
        for (DimsExprs const& o : out)
        {
            Shape s;
            for (int32_t d = 0; d < o.nbDims; ++d)
            {
                DHS_CHECK(o.d[d] != nullptr && o.d[d]->isConstant());
                s.push_back(o.d[d] != nullptr ? o.d[d]->getConstantValue() : -1);
            }
            shapes.push_back(s);
        }
        return shapes;
    }

    std::vector<DataType> output_types(std::vector<DataType> const& inputs)
    {
        std::vector<DataType> out(static_cast<size_t>(build->getNbOutputs()), DataType::kFLOAT);
        DHS_CHECK_EQ(build->getOutputDataTypes(
                         out.data(), static_cast<int32_t>(out.size()), inputs.data(), static_cast<int32_t>(inputs.size())),
            0);
        return out;
    }

    //! supportsFormatCombination for every position of a fully linear combination of `types`.
    std::vector<bool> supports(std::vector<DataType> const& types, int32_t nb_inputs, TensorFormat format = TensorFormat::kLINEAR)
    {
        std::vector<DynamicPluginTensorDesc> desc(types.size());
        for (size_t i = 0; i < types.size(); ++i)
        {
            desc[i].desc.type = types[i];
            desc[i].desc.format = format;
        }
        std::vector<bool> ok;
        for (int32_t pos = 0; pos < static_cast<int32_t>(types.size()); ++pos)
        {
            ok.push_back(build->supportsFormatCombination(
                pos, desc.data(), nb_inputs, static_cast<int32_t>(types.size()) - nb_inputs));
        }
        return ok;
    }

    int32_t configure(std::vector<Shape> const& inputs, int32_t nb_outputs)
    {
        std::vector<DynamicPluginTensorDesc> in(inputs.size()), out(static_cast<size_t>(nb_outputs));
        for (size_t i = 0; i < inputs.size(); ++i)
        {
            in[i].desc.dims.nbDims = static_cast<int32_t>(inputs[i].size());
            for (size_t d = 0; d < inputs[i].size(); ++d)
            {
                in[i].desc.dims.d[d] = inputs[i][d];
                in[i].max.d[d] = inputs[i][d];
            }
            in[i].max.nbDims = in[i].desc.dims.nbDims;
        }
        return build->configurePlugin(in.data(), static_cast<int32_t>(in.size()), out.data(), nb_outputs);
    }
};

//! Scalar fields of a collection by name (int32 and float32 values widened to double).
std::map<std::string, double> field_values(PluginFieldCollection const* fc)
{
    std::map<std::string, double> values;
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
    {
        PluginField const& f = fc->fields[i];
        DHS_CHECK(f.length == 1 && f.data != nullptr);
        if (f.type == PluginFieldType::kINT32)
        {
            int32_t v = 0;
            std::memcpy(&v, f.data, sizeof(v));
            values[f.name] = v;
        }
        else if (f.type == PluginFieldType::kFLOAT32)
        {
            float v = 0;
            std::memcpy(&v, f.data, sizeof(v));
            values[f.name] = v;
        }
    }
    return values;
}

//! Owned field collection for createPlugin.
struct Fields
{
    std::deque<int32_t> ints;
    std::deque<float> floats;
    std::vector<PluginField> list;
    PluginFieldCollection fc{};

    Fields& i32(char const* name, int32_t v)
    {
        ints.push_back(v);
        list.emplace_back(name, &ints.back(), PluginFieldType::kINT32, 1);
        return *this;
    }
    Fields& f32(char const* name, float v)
    {
        floats.push_back(v);
        list.emplace_back(name, &floats.back(), PluginFieldType::kFLOAT32, 1);
        return *this;
    }
    PluginFieldCollection const* get()
    {
        fc.nbFields = static_cast<int32_t>(list.size());
        fc.fields = list.data();
        return &fc;
    }
};

std::vector<std::string> field_names(nvinfer1::IPluginCreatorV3One* creator)
{
    std::vector<std::string> names;
    PluginFieldCollection const* fc = creator->getFieldNames();
    for (int32_t i = 0; fc != nullptr && i < fc->nbFields; ++i)
    {
        names.emplace_back(fc->fields[i].name);
    }
    return names;
}

//! Serialization round trip: fields out -> runtime-phase plugin -> the same fields out.
void check_round_trip(nvinfer1::IPluginCreatorV3One* creator, Plugin& original)
{
    PluginFieldCollection const* serial = original.runtime->getFieldsToSerialize();
    auto const values = field_values(serial);
    Plugin restored(creator->createPlugin("restored", serial, nvinfer1::TensorRTPhase::kRUNTIME));
    DHS_CHECK(restored.plugin != nullptr);
    if (restored.plugin != nullptr)
    {
        DHS_CHECK(field_values(restored.runtime->getFieldsToSerialize()) == values);
        DHS_CHECK(std::strcmp(restored.core->getPluginName(), original.core->getPluginName()) == 0);
    }
    Plugin cloned(original.plugin->clone());
    DHS_CHECK(cloned.plugin != nullptr && field_values(cloned.runtime->getFieldsToSerialize()) == values);
}

void check_resolver(nvinfer1::IPluginCreatorV3One* creator)
{
    DHS_CHECK(field_names(creator) == (std::vector<std::string>{"page_rows"}));
    DHS_CHECK(creator->createPlugin("bad", Fields{}.i32("page_rows", 0).get(), nvinfer1::TensorRTPhase::kBUILD) == nullptr);
    Fields fields;
    Plugin p(creator->createPlugin("resolver", fields.i32("page_rows", 64).get(), nvinfer1::TensorRTPhase::kBUILD));
    DHS_CHECK(p.plugin != nullptr && p.build != nullptr);
    if (p.plugin == nullptr)
    {
        return;
    }
    DHS_CHECK_EQ(p.build->getNbOutputs(), 8);
    std::vector<DataType> const in_types(6, DataType::kINT32);
    auto const out_types = p.output_types(in_types);
    for (size_t i = 0; i < out_types.size(); ++i)
    {
        DHS_CHECK(out_types[i] == (i == 1 ? DataType::kINT8 : DataType::kINT32));
    }
    // R = 3 requests, N = 2 queries x 5, M = 7 pages, B = 12 slots.
    auto const shapes = p.output_shapes({{3, 10}, {3, 7}, {3, 12}, {3, 12}, {3, 12}, {1}});
    DHS_CHECK(shapes == (std::vector<Shape>{{3, 10}, {3, 10}, {3, 12}, {3, 12}, {3, 10}, {3, 10}, {3, 10}, {3, 6}}));
    std::vector<DataType> all(14, DataType::kINT32);
    all[7] = DataType::kINT8;  // steps
    DHS_CHECK(p.supports(all, 6) == std::vector<bool>(14, true));
    all[0] = DataType::kINT64;  // positions must be int32
    DHS_CHECK(p.supports(all, 6)[0] == false);
    all[0] = DataType::kINT32;
    DHS_CHECK(p.supports(all, 6, TensorFormat::kCHW32)[0] == false);
    std::vector<DynamicPluginTensorDesc> in(6), out(8);
    in[0].max.nbDims = 2;
    in[0].max.d[0] = 128;
    in[0].max.d[1] = 4 * 2048;
    in[2].max.nbDims = 2;
    in[2].max.d[1] = 8192;
    DHS_CHECK(p.build->getWorkspaceSize(in.data(), 6, out.data(), 8) > size_t{128} * 4 * 2048 * 8);
    check_round_trip(creator, p);
}

void check_row_copy(nvinfer1::IPluginCreatorV3One* creator)
{
    DHS_CHECK(field_names(creator) == (std::vector<std::string>{"row_bytes"}));
    Fields fields;
    Plugin p(creator->createPlugin("copy", fields.i32("row_bytes", 656).get(), nvinfer1::TensorRTPhase::kBUILD));
    DHS_CHECK(p.plugin != nullptr);
    if (p.plugin == nullptr)
    {
        return;
    }
    DHS_CHECK_EQ(p.build->getNbOutputs(), 1);
    std::vector<DataType> const in_types{DataType::kUINT8, DataType::kINT64, DataType::kINT32, DataType::kINT32};
    DHS_CHECK(p.output_types(in_types) == std::vector<DataType>{DataType::kUINT8});
    DHS_CHECK(p.output_shapes({{1000, 656}, {1}, {4, 9}, {4, 9}}) == (std::vector<Shape>{{1000, 656}}));
    std::vector<DataType> all{DataType::kUINT8, DataType::kINT64, DataType::kINT32, DataType::kINT32, DataType::kUINT8};
    DHS_CHECK(p.supports(all, 4) == std::vector<bool>(5, true));
    all[1] = DataType::kINT32;  // the host address is 64-bit
    DHS_CHECK(p.supports(all, 4)[1] == false);
    DHS_CHECK_EQ(p.configure({{1000, 656}, {1}, {4, 9}, {4, 9}}, 1), 0);
    DHS_CHECK(p.configure({{1000, 1152}, {1}, {4, 9}, {4, 9}}, 1) != 0);  // row_bytes mismatch
    // In place: the output is the arena input.
    nvinfer1::InterfaceInfo const info = p.build->getInterfaceInfo();
    DHS_CHECK_EQ(info.major, 2);
    DHS_CHECK_EQ(static_cast<nvinfer1::IPluginV3OneBuildV2*>(p.build)->getAliasedInput(0), 0);
    check_round_trip(creator, p);
}

void check_sparse_mla(nvinfer1::IPluginCreatorV3One* creator)
{
    DHS_CHECK(field_names(creator)
        == (std::vector<std::string>{"kv_lora_rank", "qk_rope_head_dim", "kv_format", "softmax_scale"}));
    auto const make = [creator](int32_t rank, int32_t rope, int32_t format, float scale) {
        Fields f;
        f.i32("kv_lora_rank", rank).i32("qk_rope_head_dim", rope).i32("kv_format", format).f32("softmax_scale", scale);
        return creator->createPlugin("mla", f.get(), nvinfer1::TensorRTPhase::kBUILD);
    };
    DHS_CHECK(make(256, 64, 2, 0.1f) == nullptr);  // FP8 rows are 512 + 64 only
    DHS_CHECK(make(512, 64, 5, 0.1f) == nullptr);
    DHS_CHECK(make(512, 64, 1, 0.0f) == nullptr);
    for (int32_t format : {0, 1, 2})
    {
        Plugin p(make(512, 64, format, 0.1352f));
        DHS_CHECK(p.plugin != nullptr);
        if (p.plugin == nullptr)
        {
            continue;
        }
        DataType const kv = format == 0 ? DataType::kFLOAT : (format == 1 ? DataType::kBF16 : DataType::kUINT8);
        int64_t const width = format == 2 ? 656 : 576;
        for (DataType q : {DataType::kFLOAT, DataType::kBF16})
        {
            DHS_CHECK(p.output_types({q, q, kv, DataType::kINT32}) == std::vector<DataType>{q});
            DHS_CHECK(p.supports({q, q, kv, DataType::kINT32, q}, 4) == std::vector<bool>(5, true));
            DHS_CHECK(p.supports({q, q, kv, DataType::kINT32, DataType::kHALF}, 4)[4] == false);
        }
        DHS_CHECK(p.supports({DataType::kHALF, DataType::kHALF, kv, DataType::kINT32, DataType::kHALF}, 4)[0] == false);
        DHS_CHECK(p.supports({DataType::kFLOAT, DataType::kFLOAT, DataType::kINT8, DataType::kINT32, DataType::kFLOAT},
                      4)[2]
            == false);
        DHS_CHECK(p.output_shapes({{5, 3, 16, 512}, {5, 3, 16, 64}, {9000, width}, {5, 3, 2048}})
            == (std::vector<Shape>{{5, 3, 16, 512}}));
        DHS_CHECK_EQ(p.configure({{5, 3, 16, 512}, {5, 3, 16, 64}, {9000, width}, {5, 3, 2048}}, 1), 0);
        DHS_CHECK(p.configure({{5, 3, 16, 512}, {5, 3, 16, 64}, {9000, width + 2}, {5, 3, 2048}}, 1) != 0);
        DHS_CHECK(p.configure({{5, 3, 16, 256}, {5, 3, 16, 64}, {9000, width}, {5, 3, 2048}}, 1) != 0);
        auto const values = field_values(p.runtime->getFieldsToSerialize());
        DHS_CHECK(values.at("kv_format") == format);
        DHS_CHECK(values.at("softmax_scale") == static_cast<double>(0.1352f));
        check_round_trip(creator, p);
    }
}

} // namespace

int main(int argc, char** argv)
{
    if (argc != 2)
    {
        std::fprintf(stderr, "usage: %s <libdhisparse_trt_plugins.so>\n", argv[0]);
        return EXIT_FAILURE;
    }
    void* lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr)
    {
        std::fprintf(stderr, "dlopen failed: %s\n", dlerror());
        return EXIT_FAILURE;
    }
    using GetCreators = nvinfer1::IPluginCreatorInterface* const* (*) (int32_t&);
    auto const get_creators = reinterpret_cast<GetCreators>(dlsym(lib, "getCreators"));
    DHS_CHECK(get_creators != nullptr);
    DHS_CHECK(dlsym(lib, "setLoggerFinder") != nullptr);
    int32_t count = 0;
    nvinfer1::IPluginCreatorInterface* const* creators = get_creators != nullptr ? get_creators(count) : nullptr;
    DHS_CHECK_EQ(count, 3);
    std::map<std::string, int> seen;
    for (int32_t i = 0; i < count; ++i)
    {
        nvinfer1::InterfaceInfo const info = creators[i]->getInterfaceInfo();
        DHS_CHECK(std::strcmp(info.kind, "PLUGIN CREATOR_V3ONE") == 0);
        auto* creator = static_cast<nvinfer1::IPluginCreatorV3One*>(creators[i]);
        DHS_CHECK(std::strcmp(creator->getPluginVersion(), "1") == 0);
        DHS_CHECK(std::strcmp(creator->getPluginNamespace(), "dhisparse") == 0);
        std::string const name = creator->getPluginName();
        ++seen[name];
        if (name == "DhsResolver")
        {
            check_resolver(creator);
        }
        else if (name == "DhsRowCopy")
        {
            check_row_copy(creator);
        }
        else if (name == "DhsSparseMla")
        {
            check_sparse_mla(creator);
        }
    }
    DHS_CHECK((seen == std::map<std::string, int>{{"DhsResolver", 1}, {"DhsRowCopy", 1}, {"DhsSparseMla", 1}}));
    DHS_TEST_MAIN_END();
}
